//! Workflows: dependencies and their policies, batches' callbacks, results, progress,
//! retention, and bad input; one thread (the races are in `races`, the other aspects in this
//! folder's files).

mod deadlock_victims;
mod deadlocks;
mod edges;
mod races;
mod retry_cancel_prune;
mod transactions;
mod worker;

use std::time::Duration;

use tenure::jobs::{self, JobResult, JobState, NewJob, Outcome, RunWhen, Workflow};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, claim_one, conformance, count, job_state as state};

conformance!(
    a_dependent_waits_for_every_dependency_and_reads_their_results,
    a_dead_dependency_cancels_or_releases_as_each_dependent_chose,
    a_cancelled_dependency_counts_as_failed_and_cancels_cascade_down_a_chain,
    dependencies_already_finished_are_settled_at_enqueue,
    batch_callbacks_fire_on_success_on_the_first_failure_and_on_finish,
    a_cancelled_workflow_leaves_nothing_runnable,
    a_rescue_that_kills_a_job_settles_its_dependents,
    retention_keeps_a_dependency_until_its_dependents_finish_and_then_its_result_goes_with_it,
    progress_is_fenced_by_the_claim_and_bounded,
    bad_workflow_input_is_refused_and_writes_nothing,
);

const TTL: Duration = Duration::from_secs(120);

fn kill(conn: &mut AnyConnection, job: &jobs::ClaimedJob) {
    let outcome = jobs::fail(conn, job.claim(), "boom", jobs::Retry::Never).unwrap();
    assert_eq!(outcome, Outcome::Done);
}

/// C depends on A and B: blocked until both completed (not claimable meanwhile), then
/// waiting, and it reads both results (JSON and bytes) with their states.
fn a_dependent_waits_for_every_dependency_and_reads_their_results(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]))
        .unwrap()
        .id;
    let c = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "c", vec![]).depends_on([b, a, a]),
    )
    .unwrap()
    .id;
    assert_eq!(state(&mut conn, c), JobState::Blocked);
    let job_a = claim_one(&mut conn, "q", "a");
    let result_a = JobResult::json(&serde_json::json!({"rows": 3})).unwrap();
    assert_eq!(
        jobs::complete_with_result(&mut conn, job_a.claim(), &result_a).unwrap(),
        Outcome::Done
    );
    assert_eq!(state(&mut conn, c), JobState::Blocked);
    assert!(
        jobs::claim_kinds(&mut conn, "q", &["c"], 10, TTL)
            .unwrap()
            .is_empty()
    );
    let job_b = claim_one(&mut conn, "q", "b");
    let result_b = JobResult::bytes(vec![0u8, 255, 7]).unwrap();
    jobs::complete_with_result(&mut conn, job_b.claim(), &result_b).unwrap();
    assert_eq!(state(&mut conn, c), JobState::Waiting);
    let job_c = claim_one(&mut conn, "q", "c");
    let inputs = jobs::dependency_results(&mut conn, job_c.id).unwrap();
    assert_eq!(inputs.iter().map(|d| d.id).collect::<Vec<_>>(), vec![a, b]);
    assert!(inputs.iter().all(|d| d.state == JobState::Completed));
    assert_eq!(inputs[0].result.as_ref(), Some(&result_a));
    assert!(inputs[0].result.as_ref().unwrap().is_json());
    assert_eq!(inputs[1].result.as_ref(), Some(&result_b));
    assert!(!inputs[1].result.as_ref().unwrap().is_json());
    assert_eq!(jobs::result(&mut conn, a).unwrap(), Some(result_a));
    // A repeat of the completion keeps the first result and says so.
    let other = JobResult::json(&1).unwrap();
    assert_eq!(
        jobs::complete_with_result(&mut conn, job_b.claim(), &other).unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(jobs::result(&mut conn, b).unwrap(), Some(result_b));
}

/// One dependency dies: the AllCompleted dependent is cancelled (saying why), the
/// AllFinished one waits for the other dependency and then runs, the AnyFailed one runs at
/// once; when all complete instead, the AnyFailed one is cancelled.
fn a_dead_dependency_cancels_or_releases_as_each_dependent_chose(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]))
        .unwrap()
        .id;
    let dependent = |when: RunWhen| {
        NewJob::new("q", "d", vec![])
            .depends_on([a, b])
            .run_when(when)
    };
    let all_completed = jobs::enqueue(&mut conn, &dependent(RunWhen::AllCompleted))
        .unwrap()
        .id;
    let all_finished = jobs::enqueue(&mut conn, &dependent(RunWhen::AllFinished))
        .unwrap()
        .id;
    let any_failed = jobs::enqueue(&mut conn, &dependent(RunWhen::AnyFailed))
        .unwrap()
        .id;
    let job_a = claim_one(&mut conn, "q", "a");
    kill(&mut conn, &job_a);
    let cancelled = jobs::get(&mut conn, all_completed).unwrap().unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert!(cancelled.last_error.unwrap().contains(&a.to_string()));
    assert!(cancelled.finished_at.is_some());
    assert_eq!(state(&mut conn, all_finished), JobState::Blocked);
    assert_eq!(state(&mut conn, any_failed), JobState::Waiting);
    let job_b = claim_one(&mut conn, "q", "b");
    jobs::complete(&mut conn, &[job_b.claim()]).unwrap();
    assert_eq!(state(&mut conn, all_finished), JobState::Waiting);
    assert_eq!(state(&mut conn, any_failed), JobState::Waiting);
    assert_eq!(state(&mut conn, all_completed), JobState::Cancelled);

    // All complete: the AnyFailed dependent is cancelled, the others run.
    let x = jobs::enqueue(&mut conn, &NewJob::new("r", "x", vec![]))
        .unwrap()
        .id;
    let on_failure = NewJob::new("r", "f", vec![])
        .depends_on([x])
        .run_when(RunWhen::AnyFailed);
    let on_failure = jobs::enqueue(&mut conn, &on_failure).unwrap().id;
    let job_x = claim_one(&mut conn, "r", "x");
    jobs::complete(&mut conn, &[job_x.claim()]).unwrap();
    let job = jobs::get(&mut conn, on_failure).unwrap().unwrap();
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(job.last_error.as_deref(), Some("no dependency failed"));
}

/// A -> B -> C -> D (each AllCompleted) and E (AllFinished on C): cancelling A cancels B,
/// then C, then D, in the one call; E runs, since C finished (cancelled). A dependency that
/// dies by a snooze past its attempts counts as dead too.
fn a_cancelled_dependency_counts_as_failed_and_cancels_cascade_down_a_chain(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]).depends_on([a]))
        .unwrap()
        .id;
    let c = jobs::enqueue(&mut conn, &NewJob::new("q", "c", vec![]).depends_on([b]))
        .unwrap()
        .id;
    let d = jobs::enqueue(&mut conn, &NewJob::new("q", "d", vec![]).depends_on([c]))
        .unwrap()
        .id;
    let e = NewJob::new("q", "e", vec![])
        .depends_on([c])
        .run_when(RunWhen::AllFinished);
    let e = jobs::enqueue(&mut conn, &e).unwrap().id;
    assert!(jobs::cancel(&mut conn, a).unwrap());
    for id in [a, b, c, d] {
        assert_eq!(state(&mut conn, id), JobState::Cancelled, "job {id}");
    }
    assert_eq!(state(&mut conn, e), JobState::Waiting);

    // A running dependency asked to cancel: its dependents follow when its run ends.
    let r = jobs::enqueue(&mut conn, &NewJob::new("s", "r", vec![]))
        .unwrap()
        .id;
    let after = jobs::enqueue(
        &mut conn,
        &NewJob::new("s", "after", vec![]).depends_on([r]),
    )
    .unwrap()
    .id;
    let job_r = claim_one(&mut conn, "s", "r");
    assert!(jobs::cancel(&mut conn, r).unwrap());
    assert_eq!(state(&mut conn, after), JobState::Blocked);
    assert_eq!(
        jobs::complete(&mut conn, &[job_r.claim()]).unwrap(),
        vec![Outcome::Cancelled]
    );
    assert_eq!(state(&mut conn, after), JobState::Cancelled);

    // A snooze that leaves its job dead (no attempt left past the free snoozes).
    let s = jobs::enqueue(&mut conn, &NewJob::new("t", "s", vec![]).max_attempts(1))
        .unwrap()
        .id;
    let after_s = jobs::enqueue(
        &mut conn,
        &NewJob::new("t", "after", vec![]).depends_on([s]),
    )
    .unwrap()
    .id;
    crate::common::concrete!(&mut conn, c => {
        diesel::RunQueryDsl::execute(
            diesel::sql_query(format!("UPDATE tenure_jobs SET snoozes = 1000 WHERE id = {s}")),
            c,
        )
        .unwrap();
    });
    let job_s = claim_one(&mut conn, "t", "s");
    jobs::snooze(&mut conn, job_s.claim(), Duration::from_secs(1)).unwrap();
    assert_eq!(state(&mut conn, s), JobState::Dead);
    assert_eq!(state(&mut conn, after_s), JobState::Cancelled);
}

/// Depending on jobs that already finished: completed ones count at once (the dependent is
/// waiting when the enqueue returns), a dead one cancels an AllCompleted dependent at once.
fn dependencies_already_finished_are_settled_at_enqueue(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]))
        .unwrap()
        .id;
    let job_a = claim_one(&mut conn, "q", "a");
    jobs::complete(&mut conn, &[job_a.claim()]).unwrap();
    let job_b = claim_one(&mut conn, "q", "b");
    kill(&mut conn, &job_b);
    let on_a = jobs::enqueue(&mut conn, &NewJob::new("q", "x", vec![]).depends_on([a])).unwrap();
    assert_eq!(state(&mut conn, on_a.id), JobState::Waiting);
    let on_both =
        jobs::enqueue(&mut conn, &NewJob::new("q", "y", vec![]).depends_on([a, b])).unwrap();
    assert_eq!(state(&mut conn, on_both.id), JobState::Cancelled);
    let anyway = NewJob::new("q", "z", vec![])
        .depends_on([a, b])
        .run_when(RunWhen::AllFinished);
    let anyway = jobs::enqueue(&mut conn, &anyway).unwrap();
    assert_eq!(state(&mut conn, anyway.id), JobState::Waiting);
    // In enqueue_many too, and inside a caller's transaction that rolls back: nothing stays.
    let rolled_back: Result<(), Error> = tenure::transaction(&mut conn, |conn| {
        jobs::enqueue_many(conn, &[NewJob::new("q", "w", vec![]).depends_on([a])])?;
        Err(Error::Database(diesel::result::Error::RollbackTransaction))
    });
    assert!(rolled_back.is_err());
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = 'w'"
        ),
        0
    );
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_job_dependencies WHERE depends_on = {a}")
        ),
        3
    );
}

/// A batch of 5 with all three callbacks: all complete -> on_success and on_finish run,
/// on_failure is cancelled; one dies -> on_failure runs at that moment (before the batch
/// finished), on_success is cancelled, on_finish runs once all finished. Status counts.
fn batch_callbacks_fire_on_success_on_the_first_failure_and_on_finish(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for failing in [false, true] {
        let queue = if failing { "bad" } else { "good" };
        let mut batch = Workflow::new(format!("import-{queue}"));
        for i in 0..5 {
            batch.add(NewJob::json(queue, "part", &i).unwrap());
        }
        batch
            .on_success(NewJob::new(queue, "success", vec![]))
            .on_failure(NewJob::new(queue, "failure", vec![]))
            .on_finish(NewJob::new(queue, "finish", vec![]));
        let made = jobs::enqueue_workflow(&mut conn, &batch).unwrap();
        assert_eq!(made.jobs.len(), 5);
        let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
        assert_eq!(status.counts.waiting, 5);
        assert_eq!(
            status.counts.blocked, 0,
            "callbacks are not counted: {status:?}"
        );
        assert_eq!(
            status.on_success,
            Some((made.on_success.unwrap(), JobState::Blocked))
        );
        let parts = jobs::claim_kinds(&mut conn, queue, &["part"], 10, TTL).unwrap();
        assert_eq!(parts.len(), 5);
        if failing {
            kill(&mut conn, &parts[2]);
            let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
            assert_eq!(status.on_failure.unwrap().1, JobState::Waiting);
            assert_eq!(status.on_success.unwrap().1, JobState::Cancelled);
            assert_eq!(status.on_finish.unwrap().1, JobState::Blocked);
        }
        let rest: Vec<_> = parts
            .iter()
            .filter(|p| !(failing && p.id == parts[2].id))
            .map(|p| p.claim())
            .collect();
        jobs::complete(&mut conn, &rest).unwrap();
        let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
        assert_eq!(status.counts.completed, if failing { 4 } else { 5 });
        assert_eq!(status.counts.dead, if failing { 1 } else { 0 });
        assert_eq!(status.counts.unfinished(), 0);
        let expect = |fires: bool| {
            if fires {
                JobState::Waiting
            } else {
                JobState::Cancelled
            }
        };
        assert_eq!(status.on_success.unwrap().1, expect(!failing));
        assert_eq!(status.on_failure.unwrap().1, expect(failing));
        assert_eq!(status.on_finish.unwrap().1, JobState::Waiting);
        // The callbacks read the batch's jobs.
        let finish = claim_one(&mut conn, queue, "finish");
        assert_eq!(
            jobs::dependency_results(&mut conn, finish.id)
                .unwrap()
                .len(),
            5
        );
        assert_eq!(
            jobs::get(&mut conn, finish.id)
                .unwrap()
                .unwrap()
                .workflow_id,
            Some(made.id)
        );
    }
}

/// A workflow with a running job, a waiting one and blocked ones: cancelling it leaves no
/// job claimable, the running one is cancelled when its run ends, and nothing is released.
fn a_cancelled_workflow_leaves_nothing_runnable(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut flow = Workflow::new("etl");
    let a = flow.add(NewJob::new("q", "a", vec![]));
    let b = flow.add(NewJob::new("q", "b", vec![]));
    let c = flow.add_after(
        &[a],
        NewJob::new("q", "c", vec![]).run_when(RunWhen::AllFinished),
    );
    flow.add_after(
        &[b, c],
        NewJob::new("q", "d", vec![]).run_when(RunWhen::AllFinished),
    );
    flow.on_finish(NewJob::new("q", "finish", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    let running = claim_one(&mut conn, "q", "a");
    assert_eq!(jobs::cancel_workflow(&mut conn, made.id).unwrap(), 5);
    assert!(jobs::claim(&mut conn, "q", 100, TTL).unwrap().is_empty());
    assert_eq!(
        jobs::complete(&mut conn, &[running.claim()]).unwrap(),
        vec![Outcome::Cancelled]
    );
    assert!(jobs::claim(&mut conn, "q", 100, TTL).unwrap().is_empty());
    let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
    assert_eq!(status.counts.cancelled, 4, "{status:?}");
    assert_eq!(status.on_finish.unwrap().1, JobState::Cancelled);
    let graph = jobs::workflow_jobs(&mut conn, made.id).unwrap();
    assert_eq!(graph.len(), 5);
    assert_eq!(graph[3].dependencies, vec![made.jobs[1], made.jobs[2]]);
}

/// A job whose claims lapse until it is dead (rescue): its AllCompleted dependent is
/// cancelled and its AnyFailed dependent released, by the rescue's transaction.
fn a_rescue_that_kills_a_job_settles_its_dependents(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let after = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "after", vec![]).depends_on([a]),
    )
    .unwrap()
    .id;
    let alarm = NewJob::new("q", "alarm", vec![])
        .depends_on([a])
        .run_when(RunWhen::AnyFailed);
    let alarm = jobs::enqueue(&mut conn, &alarm).unwrap().id;
    for _ in 0..jobs::MAX_LAPSES {
        let claimed =
            jobs::claim_kinds(&mut conn, "q", &["a"], 1, Duration::from_millis(1)).unwrap();
        let expires = claimed[0].claim_expires_at;
        crate::common::wait_for_db_clock(&mut conn, expires);
        let rescued = jobs::rescue(&mut conn, 10).unwrap();
        assert_eq!(rescued.requeued.len() + rescued.dead.len(), 1);
    }
    assert_eq!(state(&mut conn, a), JobState::Dead);
    assert_eq!(state(&mut conn, after), JobState::Cancelled);
    assert_eq!(state(&mut conn, alarm), JobState::Waiting);
}

/// Prune (DeleteAll) keeps a completed dependency while a dependent is blocked, waiting or
/// running, and deletes it (its result, its edges) once the dependent finished.
fn retention_keeps_a_dependency_until_its_dependents_finish_and_then_its_result_goes_with_it(
    backend: Backend,
) {
    use jobs::{Finished, Retention};
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]))
        .unwrap()
        .id;
    let c = jobs::enqueue(&mut conn, &NewJob::new("q", "c", vec![]).depends_on([a, b])).unwrap();
    let job_a = claim_one(&mut conn, "q", "a");
    jobs::complete_with_result(&mut conn, job_a.claim(), &JobResult::json(&"a").unwrap()).unwrap();
    let prune = |conn: &mut AnyConnection| {
        jobs::prune(conn, "q", Finished::Completed, Retention::DeleteAll, 100).unwrap()
    };
    assert_eq!(prune(&mut conn), 0, "blocked dependent");
    let job_b = claim_one(&mut conn, "q", "b");
    jobs::complete(&mut conn, &[job_b.claim()]).unwrap();
    assert_eq!(prune(&mut conn), 0, "waiting dependent");
    let job_c = claim_one(&mut conn, "q", "c");
    assert_eq!(prune(&mut conn), 0, "running dependent");
    assert_eq!(jobs::dependency_results(&mut conn, c.id).unwrap().len(), 2);
    jobs::complete(&mut conn, &[job_c.claim()]).unwrap();
    assert_eq!(prune(&mut conn), 3);
    for table in [
        "tenure_job_results",
        "tenure_job_dependencies",
        "tenure_dependency_stripes",
    ] {
        assert_eq!(
            count(&mut conn, &format!("SELECT COUNT(*) AS n FROM {table}")),
            0,
            "{table}"
        );
    }
}

/// record_progress writes only under the claim; a message is cut to the bound and NUL is
/// stored; a number that is not finite is refused; set_progress on a context with no
/// connection at all is called a million times (no write per call).
fn progress_is_fenced_by_the_claim_and_bounded(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let job = claim_one(&mut conn, "q", "a");
    let long = format!("é{}\0", "x".repeat(1000));
    assert_eq!(
        jobs::record_progress(&mut conn, job.claim(), 0.25, &long).unwrap(),
        Outcome::Done
    );
    let (value, message) = jobs::progress(&mut conn, id).unwrap().unwrap();
    assert_eq!(value, 0.25);
    assert!(message.len() <= jobs::MAX_PROGRESS_MESSAGE_BYTES && message.starts_with('é'));
    for bad in [f64::NAN, f64::INFINITY] {
        assert!(matches!(
            jobs::record_progress(&mut conn, job.claim(), bad, "x"),
            Err(Error::InvalidInput { .. })
        ));
    }
    let mut stale = job.claim();
    stale.token = uuid::Uuid::new_v4();
    assert_eq!(
        jobs::record_progress(&mut conn, stale, 0.9, "no").unwrap(),
        Outcome::Lost
    );
    jobs::complete(&mut conn, &[job.claim()]).unwrap();
    assert_eq!(
        jobs::record_progress(&mut conn, job.claim(), 0.9, "late").unwrap(),
        Outcome::Lost
    );
    assert_eq!(jobs::progress(&mut conn, id).unwrap().unwrap().0, 0.25);
    let ctx = tenure::testing::context("q", "a");
    for i in 0..1_000_000 {
        ctx.set_progress(i as f64, "tight loop");
    }
    assert_eq!(tenure::testing::progress_of(&ctx).unwrap().0, 999_999.0);
}

/// Each is InvalidInput, and nothing is written: a dependency that does not exist, a
/// dependent with a dedup key, too many dependencies, a result too long (the job stays
/// running), a workflow with no steps or with a step depending on a later one, or with a
/// bad job in it.
fn bad_workflow_input_is_refused_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    fn invalid<T>(r: Result<T, Error>) -> bool {
        matches!(r, Err(Error::InvalidInput { .. }))
    }
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    assert!(invalid(jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "x", vec![]).depends_on([a, a + 1000])
    )));
    assert!(invalid(jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "x", vec![]).depends_on([a]).dedup_key("k")
    )));
    let many = NewJob::new("q", "x", vec![]).depends_on(0..(jobs::MAX_DEPENDENCIES as i64 + 1));
    assert!(invalid(jobs::enqueue(&mut conn, &many)));
    assert!(invalid(jobs::enqueue_workflow(
        &mut conn,
        &Workflow::new("empty")
    )));
    let mut other = Workflow::new("other");
    let foreign = other.add(NewJob::new("q", "x", vec![]));
    other.add(NewJob::new("q", "x", vec![]));
    let mut flow = Workflow::new("flow");
    flow.add_after(&[foreign], NewJob::new("q", "x", vec![]));
    assert!(
        invalid(jobs::enqueue_workflow(&mut conn, &flow)),
        "a step from another workflow"
    );
    let mut bad_job = Workflow::new("flow");
    bad_job.add(NewJob::new("q", "x", vec![]));
    bad_job.add(NewJob::new("q", "", vec![]));
    assert!(invalid(jobs::enqueue_workflow(&mut conn, &bad_job)));
    let mut missing = Workflow::new("flow");
    missing.add(NewJob::new("q", "x", vec![]));
    missing.add(NewJob::new("q", "x", vec![]).depends_on([a + 1000]));
    assert!(invalid(jobs::enqueue_workflow(&mut conn, &missing)));
    for table in [
        "tenure_workflows",
        "tenure_job_dependencies",
        "tenure_dependency_stripes",
    ] {
        assert_eq!(
            count(&mut conn, &format!("SELECT COUNT(*) AS n FROM {table}")),
            0,
            "{table}"
        );
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 1);
    assert!(invalid(JobResult::bytes(vec![
        0u8;
        jobs::MAX_RESULT_BYTES + 1
    ])));
    let job = claim_one(&mut conn, "q", "a");
    let biggest = JobResult::bytes(vec![7u8; jobs::MAX_RESULT_BYTES]).unwrap();
    assert_eq!(
        jobs::complete_with_result(&mut conn, job.claim(), &biggest).unwrap(),
        Outcome::Done
    );
    assert_eq!(
        jobs::result(&mut conn, a)
            .unwrap()
            .unwrap()
            .as_bytes()
            .len(),
        jobs::MAX_RESULT_BYTES
    );
}

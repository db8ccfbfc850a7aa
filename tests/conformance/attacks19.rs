//! Attacks on workflows (dependencies, batches' callbacks, results): caller's transactions
//! at REPEATABLE READ, a dead dependency retried, lock orders of `cancel_workflow` and of
//! `enqueue_many` against completions, and races of cancel, prune and enqueue with the
//! finish of a dependency.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use diesel::Connection;
use diesel::connection::SimpleConnection;

use tenure::jobs::{
    self, Finished, JobResult, JobState, NewJob, Outcome, Retention, RunWhen, Workflow,
};
use tenure::{Backend, Error};

use crate::common::{
    TestDb, claim_one, conformance, contest, count, enqueue_id as enqueue, job_state as state,
};

conformance!(
    a_completion_in_a_repeatable_read_transaction_never_misses_a_dependent,
    a_retried_dead_dependency_is_waited_for_again_by_an_all_finished_dependent,
    cancel_workflow_racing_a_batch_completion_does_not_deadlock,
    enqueue_many_racing_a_completion_does_not_deadlock,
    cancel_of_a_blocked_job_racing_its_last_dependency_is_decided_once,
    prune_racing_an_enqueue_of_a_dependent_never_deletes_its_dependency,
    a_completion_with_a_result_rolled_back_with_the_callers_transaction_leaves_nothing,
    a_fan_in_of_2000_completed_in_batches_of_50_in_mixed_orders_by_8_threads,
    odd_dependency_lists_are_refused_or_normalised,
);

const TTL: Duration = Duration::from_secs(120);

/// A handler's own transaction at REPEATABLE READ (MySQL's default isolation; a choice on
/// PostgreSQL) reads first, then completes its job. Meanwhile a second dependent of the job
/// was enqueued (the job already had one, so its row is not written again). Either the
/// completion fails (a serialization error, nothing changed) or it releases both
/// dependents: it must never commit the completion and leave the second one blocked.
fn a_completion_in_a_repeatable_read_transaction_never_misses_a_dependent(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut handler = db.connect();
    match backend {
        Backend::Postgres => handler.batch_execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        ),
        Backend::Mysql => {
            handler.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        }
        Backend::Sqlite => Ok(()),
    }
    .unwrap();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let first = enqueue(&mut conn, NewJob::new("d", "first", vec![]).depends_on([a]));
    let job_a = claim_one(&mut conn, "q", "a");
    let mut second = 0;
    let outcome = handler.transaction::<_, Error, _>(|h| {
        // The handler reads (its snapshot starts here) ...
        assert_eq!(jobs::get(h, a)?.unwrap().state, JobState::Running);
        // ... another process adds a dependent of the job and commits ...
        second = enqueue(
            &mut conn,
            NewJob::new("d", "second", vec![]).depends_on([a]),
        );
        // ... and the handler completes its job.
        jobs::complete(h, &[job_a.claim()])
    });
    match outcome {
        Ok(outcomes) => {
            assert_eq!(outcomes, vec![Outcome::Done]);
            assert_eq!(state(&mut conn, a), JobState::Completed);
            assert_eq!(
                state(&mut conn, first),
                JobState::Waiting,
                "first dependent"
            );
            let edge = count(
                &mut conn,
                &format!(
                    "SELECT COUNT(*) AS n FROM tenure_job_dependencies \
                     WHERE job_id = {second} AND counted = 1"
                ),
            );
            assert_eq!(
                state(&mut conn, second),
                JobState::Waiting,
                "the completion committed, but the dependent enqueued after the handler's \
                 snapshot was left blocked forever (its edge counted: {edge})"
            );
        }
        Err(e) => {
            assert!(e.is_retryable(), "not a serialization error: {e}");
            assert_eq!(state(&mut conn, a), JobState::Running);
            assert_eq!(state(&mut conn, second), JobState::Blocked);
        }
    }
}

/// C runs when A and B have finished, however. A dies (counted as finished), an operator
/// retries A (waiting again), then B completes: C must not run while A runs again.
fn a_retried_dead_dependency_is_waited_for_again_by_an_all_finished_dependent(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let b = enqueue(&mut conn, NewJob::new("q", "b", vec![]));
    let c = NewJob::new("q", "c", vec![])
        .depends_on([a, b])
        .run_when(RunWhen::AllFinished);
    let c = enqueue(&mut conn, c);
    let job_a = claim_one(&mut conn, "q", "a");
    jobs::fail(&mut conn, job_a.claim(), "boom", jobs::Retry::Never).unwrap();
    assert!(jobs::retry_dead(&mut conn, a).unwrap());
    assert_eq!(state(&mut conn, a), JobState::Waiting);
    let job_b = claim_one(&mut conn, "q", "b");
    jobs::complete(&mut conn, &[job_b.claim()]).unwrap();
    assert_eq!(
        state(&mut conn, c),
        JobState::Blocked,
        "C was released while its dependency A (retried) is {:?}",
        state(&mut conn, a)
    );
}

/// A worker's finisher completes a batch [Z, A]: Z has 300 dependents, A is a step of a
/// workflow whose on_finish callback F also waits for a step B0 of lower id. While the
/// completion settles Z's dependents (holding A's row), the workflow is cancelled:
/// `cancel_workflow` cancels B0 (taking F's stripe) and then waits for A's row, while the
/// completion reaches F's stripe. Both calls must succeed.
fn cancel_workflow_racing_a_batch_completion_does_not_deadlock(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let z = enqueue(&mut conn, NewJob::new("z", "z", vec![]));
    let fan: Vec<NewJob> = (0..300)
        .map(|_| NewJob::new("y", "y", vec![]).depends_on([z]))
        .collect();
    jobs::enqueue_many(&mut conn, &fan).unwrap();
    let mut flow = Workflow::new("w");
    flow.add(NewJob::new("w", "b0", vec![]));
    flow.add(NewJob::new("w", "a", vec![]));
    flow.on_finish(NewJob::new("w", "finish", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    let claims = vec![
        claim_one(&mut conn, "z", "z").claim(),
        claim_one(&mut conn, "w", "a").claim(),
    ];
    let workflow = made.id;
    let barrier = Arc::new(Barrier::new(2));
    let (mut c1, mut c2) = (db.connect(), db.connect());
    let b1 = barrier.clone();
    let completer = std::thread::spawn(move || {
        b1.wait();
        jobs::complete(&mut c1, &claims)
    });
    let canceller = std::thread::spawn(move || {
        barrier.wait();
        std::thread::sleep(Duration::from_millis(30));
        jobs::cancel_workflow(&mut c2, workflow)
    });
    let completed = completer.join().unwrap();
    let cancelled = canceller.join().unwrap();
    assert!(
        completed.is_ok() && cancelled.is_ok(),
        "complete: {completed:?}; cancel_workflow: {cancelled:?}"
    );
    assert!(jobs::claim(&mut conn, "w", 10, TTL).unwrap().is_empty());
}

/// `enqueue_many([J1 after B, 60 jobs after other jobs, J2 after A])` locks B, then A; a
/// completion of A (B depends on A) locks A, then B's row to release it. Both must succeed.
fn enqueue_many_racing_a_completion_does_not_deadlock(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let b = enqueue(&mut conn, NewJob::new("d", "b", vec![]).depends_on([a]));
    let others: Vec<i64> = jobs::enqueue_many(
        &mut conn,
        &(0..60)
            .map(|_| NewJob::new("o", "o", vec![]))
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .iter()
    .map(|e| e.id)
    .collect();
    let job_a = claim_one(&mut conn, "q", "a");
    let mut batch = vec![NewJob::new("n", "j1", vec![]).depends_on([b])];
    batch.extend(
        others
            .iter()
            .map(|o| NewJob::new("n", "k", vec![]).depends_on([*o])),
    );
    batch.push(NewJob::new("n", "j2", vec![]).depends_on([a]));
    let barrier = Arc::new(Barrier::new(2));
    let (mut c1, mut c2) = (db.connect(), db.connect());
    let b1 = barrier.clone();
    let enqueuer = std::thread::spawn(move || {
        b1.wait();
        jobs::enqueue_many(&mut c1, &batch).map(|made| made.len())
    });
    let completer = std::thread::spawn(move || {
        barrier.wait();
        std::thread::sleep(Duration::from_millis(10));
        jobs::complete(&mut c2, &[job_a.claim()])
    });
    let enqueued = enqueuer.join().unwrap();
    let completed = completer.join().unwrap();
    assert!(
        enqueued.is_ok() && completed.is_ok(),
        "enqueue_many: {enqueued:?}; complete: {completed:?}"
    );
    assert_eq!(state(&mut conn, b), JobState::Waiting);
}

/// D is blocked on A alone; in each round A's completion and D's cancel run at the same
/// instant. Both succeed, the cancel returns true, and D ends cancelled (never runnable).
fn cancel_of_a_blocked_job_racing_its_last_dependency_is_decided_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    const ROUNDS: usize = 30;
    let mut pairs = Vec::new();
    for _ in 0..ROUNDS {
        let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
        let d = enqueue(&mut conn, NewJob::new("d", "d", vec![]).depends_on([a]));
        pairs.push((claim_one(&mut conn, "q", "a"), d));
    }
    let pairs = Arc::new(pairs);
    let shared = pairs.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, c| {
            let (job, d) = &shared[round];
            if thread == 0 {
                jobs::complete(c, &[job.claim()]).map(|o| format!("{o:?}"))
            } else {
                jobs::cancel(c, *d).map(|o| format!("{o}"))
            }
        },
        move |round, results| {
            let (_, d) = &pairs[round];
            assert!(
                results.iter().all(|r| r.is_ok()),
                "round {round}: {results:?}"
            );
            assert_eq!(results[1].as_ref().unwrap(), "true", "round {round}");
            assert_eq!(state(&mut conn, *d), JobState::Cancelled, "round {round}");
        },
    );
}

/// A is completed and prunable; in each round one thread enqueues a dependent of A while
/// another prunes A's queue. Either the enqueue is refused (A is gone) or A stays as long
/// as its dependent is unfinished.
fn prune_racing_an_enqueue_of_a_dependent_never_deletes_its_dependency(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    const ROUNDS: usize = 40;
    let mut done = Vec::new();
    for _ in 0..ROUNDS {
        let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
        let job = claim_one(&mut conn, "q", "a");
        jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json(&a).unwrap()).unwrap();
        done.push(a);
    }
    let done = Arc::new(done);
    let shared = done.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, c| {
            if thread == 0 {
                let job = NewJob::new("d", "d", vec![]).depends_on([shared[round]]);
                jobs::enqueue(c, &job).map(|e| e.id)
            } else {
                jobs::prune(c, "q", Finished::Completed, Retention::DeleteAll, 1000)
                    .map(|n| n as i64)
            }
        },
        move |round, results| {
            let a = done[round];
            assert!(results[1].is_ok(), "round {round}: prune {:?}", results[1]);
            match &results[0] {
                Ok(d) => {
                    assert_eq!(state(&mut conn, *d), JobState::Waiting, "round {round}");
                    assert!(
                        jobs::get(&mut conn, a).unwrap().is_some(),
                        "round {round}: dependency {a} pruned while {d} waits"
                    );
                    assert_eq!(jobs::dependency_results(&mut conn, *d).unwrap().len(), 1);
                    let job = claim_one(&mut conn, "d", "d");
                    jobs::complete(&mut conn, &[job.claim()]).unwrap();
                }
                Err(e) => assert!(e.is_invalid_input(), "round {round}: enqueue {e}"),
            }
        },
    );
}

/// A completion with a result inside the caller's transaction that rolls back: the job is
/// still running, no result, its dependent blocked; completing again (another result)
/// releases the dependent, which reads the second result.
fn a_completion_with_a_result_rolled_back_with_the_callers_transaction_leaves_nothing(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let d = enqueue(&mut conn, NewJob::new("q", "d", vec![]).depends_on([a]));
    let job_a = claim_one(&mut conn, "q", "a");
    let rolled: Result<(), Error> = tenure::transaction(&mut conn, |c| {
        let first = JobResult::bytes(vec![0xff, 0xfe, 0]).unwrap();
        assert_eq!(
            jobs::complete_with_result(c, job_a.claim(), &first)?,
            Outcome::Done
        );
        Err(Error::Database(diesel::result::Error::RollbackTransaction))
    });
    assert!(rolled.is_err());
    assert_eq!(state(&mut conn, a), JobState::Running);
    assert_eq!(state(&mut conn, d), JobState::Blocked);
    assert_eq!(jobs::result(&mut conn, a).unwrap(), None);
    let second = JobResult::json(&"second").unwrap();
    assert_eq!(
        jobs::complete_with_result(&mut conn, job_a.claim(), &second).unwrap(),
        Outcome::Done
    );
    assert_eq!(state(&mut conn, d), JobState::Waiting);
    let read = jobs::dependency_results(&mut conn, d).unwrap();
    assert_eq!(read[0].result.as_ref(), Some(&second));
}

/// One job depends on 2,000 (the stripes cap); 8 threads claim 50 at a time and complete
/// each batch in one call, listing the claims reversed or rotated: no error, and the
/// dependent is released exactly once, after the last.
fn a_fan_in_of_2000_completed_in_batches_of_50_in_mixed_orders_by_8_threads(backend: Backend) {
    const N: usize = 2000;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for chunk in 0..N / 500 {
        let batch: Vec<NewJob> = (0..500)
            .map(|i| NewJob::json("f", "part", &(chunk * 500 + i)).unwrap())
            .collect();
        ids.extend(
            jobs::enqueue_many(&mut conn, &batch)
                .unwrap()
                .iter()
                .map(|e| e.id),
        );
    }
    let join = enqueue(&mut conn, NewJob::new("j", "join", vec![]).depends_on(ids));
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_dependency_stripes WHERE job_id = {join}")
        ),
        jobs::MAX_STRIPES as i64
    );
    let errors = crate::common::race(&db, 8, move |t, c| {
        let mut errors = Vec::new();
        let mut round = 0usize;
        loop {
            let claimed = match jobs::claim(c, "f", 50, TTL) {
                Ok(claimed) if claimed.is_empty() => return errors,
                Ok(claimed) => claimed,
                Err(e) => {
                    errors.push(format!("claim: {e}"));
                    continue;
                }
            };
            let mut claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
            round += 1;
            if (t + round) % 2 == 0 {
                claims.reverse();
            } else {
                let k = (t * 7 + round) % claims.len();
                claims.rotate_left(k);
            }
            match jobs::complete(c, &claims) {
                Ok(o) if o.iter().all(|o| *o == Outcome::Done) => {}
                Ok(o) => errors.push(format!("outcomes {o:?}")),
                Err(e) => errors.push(format!("complete: {e}")),
            }
        }
    });
    let errors: Vec<String> = errors.into_iter().flatten().collect();
    assert!(
        errors.is_empty(),
        "{} errors: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert_eq!(state(&mut conn, join), JobState::Waiting);
    assert_eq!(jobs::claim(&mut conn, "j", 10, TTL).unwrap().len(), 1);
}

/// Negative and missing ids are refused and write nothing; repeats count once (the
/// dependent is released by the one completion).
fn odd_dependency_lists_are_refused_or_normalised(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    for bad in [vec![-1], vec![a, i64::MAX], vec![0, a], vec![i64::MIN, a]] {
        let r = jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "x", vec![]).depends_on(bad.clone()),
        );
        assert!(
            matches!(r, Err(Error::InvalidInput { .. })),
            "{bad:?}: {r:?}"
        );
    }
    let many = NewJob::new("q", "x", vec![]).depends_on(vec![a; 5000]);
    assert!(
        jobs::enqueue_many(
            &mut conn,
            &[many.clone(), NewJob::new("q", "y", vec![]), many]
        )
        .is_ok()
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_job_dependencies"
        ),
        2
    );
    let job = claim_one(&mut conn, "q", "a");
    jobs::complete(&mut conn, &[job.claim()]).unwrap();
    assert_eq!(
        jobs::claim_kinds(&mut conn, "q", &["x"], 10, TTL)
            .unwrap()
            .len(),
        2
    );
}

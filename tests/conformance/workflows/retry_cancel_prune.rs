//! Dependencies retried, cancelled and pruned while they finish: a retried dead dependency is
//! waited for again, a cancel racing the last dependency is decided once, a prune never deletes
//! a dependency being enqueued against (nor one a dead dependent could be revived to read),
//! and `retry_dead` never strands a dependent.

use std::sync::Arc;

use tenure::Backend;
use tenure::jobs::{self, Finished, JobResult, JobState, NewJob, Outcome, Retention, RunWhen};

use crate::common::{
    TestDb, claim_one, conformance, contest, count, enqueue_id as enqueue, job_state as state,
};

conformance!(
    a_retried_dead_dependency_is_waited_for_again_by_an_all_finished_dependent,
    cancel_of_a_blocked_job_racing_its_last_dependency_is_decided_once,
    prune_racing_an_enqueue_of_a_dependent_never_deletes_its_dependency,
    retry_dead_racing_the_last_other_dependency_never_strands_the_dependent,
    retry_then_death_then_retry_keeps_an_all_finished_dependent_waiting,
    a_dead_dependents_inputs_outlive_a_prune_so_its_revival_reads_them,
    a_workflows_row_goes_with_its_last_job,
);

// Found by the round-19 attacks on workflows: REPEATABLE READ callers, a retried dead dependency, lock orders, races with a dependency's finish (attacks19.rs).
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

// Found by the round-19 attacks on workflows: REPEATABLE READ callers, a retried dead dependency, lock orders, races with a dependency's finish (attacks19.rs).
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

// Found by the round-19 attacks on workflows: REPEATABLE READ callers, a retried dead dependency, lock orders, races with a dependency's finish (attacks19.rs).
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

// Found by the second round-19 attacks on workflows: finishers holding rows of higher id than a dependent they settle, retry_dead against completions (attacks19b.rs).
/// In each round C (AllFinished) waits for A and B, A is dead (counted), and `retry_dead(A)`
/// races B's completion. Both succeed, and either C waits for A (blocked; A's completion
/// then releases it) or the completion went first and released C before the retry.
fn retry_dead_racing_the_last_other_dependency_never_strands_the_dependent(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    const ROUNDS: usize = 30;
    let mut rounds = Vec::new();
    for r in 0..ROUNDS {
        let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
        let b = enqueue(&mut conn, NewJob::new("q", "b", vec![]));
        let mut deps = [a, b];
        if r % 2 == 1 {
            deps.reverse();
        }
        let c = enqueue(
            &mut conn,
            NewJob::new("c", "c", vec![])
                .depends_on(deps)
                .run_when(RunWhen::AllFinished),
        );
        let job_a = claim_one(&mut conn, "q", "a");
        jobs::fail(&mut conn, job_a.claim(), "boom", jobs::Retry::Never).unwrap();
        let job_b = claim_one(&mut conn, "q", "b");
        rounds.push((a, job_b, c));
    }
    let rounds = Arc::new(rounds);
    let shared = rounds.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, conn| {
            let (a, job_b, _) = &shared[round];
            if thread == 0 {
                jobs::retry_dead(conn, *a).map(|r| format!("{r}"))
            } else {
                jobs::complete(conn, &[job_b.claim()]).map(|o| format!("{o:?}"))
            }
        },
        move |round, results| {
            let (a, _, c) = &rounds[round];
            assert!(
                results.iter().all(|r| r.is_ok()),
                "round {round}: {results:?}"
            );
            assert_eq!(results[0].as_ref().unwrap(), "true", "round {round}");
            assert_eq!(state(&mut conn, *a), JobState::Waiting, "round {round}");
            let job_a = claim_one(&mut conn, "q", "a");
            match state(&mut conn, *c) {
                JobState::Blocked => {
                    assert_eq!(
                        jobs::complete(&mut conn, &[job_a.claim()]).unwrap(),
                        vec![Outcome::Done]
                    );
                    assert_eq!(
                        state(&mut conn, *c),
                        JobState::Waiting,
                        "round {round}: C stranded after A's retried run completed"
                    );
                }
                JobState::Waiting => {
                    jobs::complete(&mut conn, &[job_a.claim()]).unwrap();
                }
                other => panic!("round {round}: C is {other:?}"),
            }
            let job_c = claim_one(&mut conn, "c", "c");
            jobs::complete(&mut conn, &[job_c.claim()]).unwrap();
        },
    );
}

// Found by the second round-19 attacks on workflows: finishers holding rows of higher id than a dependent they settle, retry_dead against completions (attacks19b.rs).
/// C (AllFinished) waits for A and B. A dies, is retried, dies again, is retried again;
/// B completes: C still waits; A completes: C runs. A second `retry_dead` of a waiting job
/// changes nothing.
fn retry_then_death_then_retry_keeps_an_all_finished_dependent_waiting(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let b = enqueue(&mut conn, NewJob::new("q", "b", vec![]));
    let c = enqueue(
        &mut conn,
        NewJob::new("c", "c", vec![])
            .depends_on([a, b])
            .run_when(RunWhen::AllFinished),
    );
    for _ in 0..2 {
        let job_a = claim_one(&mut conn, "q", "a");
        jobs::fail(&mut conn, job_a.claim(), "boom", jobs::Retry::Never).unwrap();
        assert_eq!(state(&mut conn, c), JobState::Blocked);
        assert!(jobs::retry_dead(&mut conn, a).unwrap());
        assert!(!jobs::retry_dead(&mut conn, a).unwrap());
    }
    let job_b = claim_one(&mut conn, "q", "b");
    jobs::complete(&mut conn, &[job_b.claim()]).unwrap();
    assert_eq!(
        state(&mut conn, c),
        JobState::Blocked,
        "C ran while A waits"
    );
    let job_a = claim_one(&mut conn, "q", "a");
    jobs::complete(&mut conn, &[job_a.claim()]).unwrap();
    assert_eq!(state(&mut conn, c), JobState::Waiting);
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_job_dependencies WHERE job_id = {c} AND counted = 0"
            )
        ),
        0
    );
}

/// C reads A's result. C dies; a prune of every completed job runs; an operator revives C.
/// C must read A's result as before. Found by issue 32's review: the prune deleted A and its
/// result (only blocked, waiting and running dependents kept a dependency), `retry_dead`
/// revived C, and C ran reading no result and no error. A dead dependent keeps its
/// dependencies until it is pruned itself; then they go at the next prune.
fn a_dead_dependents_inputs_outlive_a_prune_so_its_revival_reads_them(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let c = enqueue(&mut conn, NewJob::new("q", "c", vec![]).depends_on([a]));
    let job_a = claim_one(&mut conn, "q", "a");
    let result = JobResult::json(&"from A").unwrap();
    assert_eq!(
        jobs::complete_with_result(&mut conn, job_a.claim(), &result).unwrap(),
        Outcome::Done
    );
    let job_c = claim_one(&mut conn, "q", "c");
    assert_eq!(jobs::dependency_results(&mut conn, c).unwrap().len(), 1);
    jobs::fail(&mut conn, job_c.claim(), "boom", jobs::Retry::Never).unwrap();
    assert_eq!(state(&mut conn, c), JobState::Dead);
    let prune = |conn: &mut _, finished| {
        jobs::prune(conn, "q", finished, Retention::DeleteAll, 1000).unwrap()
    };
    assert_eq!(
        prune(&mut conn, Finished::Completed),
        0,
        "A, which dead C reads, was pruned"
    );
    assert!(jobs::retry_dead(&mut conn, c).unwrap());
    let job_c = claim_one(&mut conn, "q", "c");
    let inputs = jobs::dependency_results(&mut conn, c).unwrap();
    assert_eq!(inputs.len(), 1, "the revived C reads no result of A");
    assert_eq!(inputs[0].id, a);
    let read: String = inputs[0]
        .result
        .as_ref()
        .expect("A's result")
        .decode()
        .unwrap();
    assert_eq!(read, "from A");
    // Dead again and pruned itself, C no longer keeps A: the next prune takes A.
    jobs::fail(&mut conn, job_c.claim(), "boom", jobs::Retry::Never).unwrap();
    assert_eq!(prune(&mut conn, Finished::Dead), 1);
    assert_eq!(prune(&mut conn, Finished::Completed), 1);
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
}

/// Two workflows of two jobs each; all four complete; a prune keeping the newest one deletes
/// the three others: the workflow left without a job loses its row, the one with a job kept
/// keeps it (and its status). Found by issue 32's review: `tenure_workflows` rows were never
/// pruned.
fn a_workflows_row_goes_with_its_last_job(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut made = Vec::new();
    for name in ["first", "second"] {
        let mut workflow = jobs::Workflow::new(name);
        workflow.add(NewJob::new("q", "a", vec![]));
        workflow.add(NewJob::new("q", "b", vec![]));
        made.push(jobs::enqueue_workflow(&mut conn, &workflow).unwrap().id);
    }
    for _ in 0..4 {
        let job = jobs::claim(&mut conn, "q", 1, std::time::Duration::from_secs(60))
            .unwrap()
            .remove(0);
        jobs::complete(&mut conn, &[job.claim()]).unwrap();
    }
    let deleted = jobs::prune(
        &mut conn,
        "q",
        Finished::Completed,
        Retention::KeepNewest(1),
        1000,
    );
    assert_eq!(deleted.unwrap(), 3);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_workflows"),
        1
    );
    assert!(jobs::workflow_status(&mut conn, made[0]).unwrap().is_none());
    let kept = jobs::workflow_status(&mut conn, made[1])
        .unwrap()
        .expect("its row");
    assert_eq!(kept.counts.completed, 1);
    assert_eq!(
        jobs::prune(
            &mut conn,
            "q",
            Finished::Completed,
            Retention::DeleteAll,
            1000
        )
        .unwrap(),
        1
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_workflows"),
        0
    );
}

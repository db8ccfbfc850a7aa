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
    concurrent_prunes_of_a_workflows_last_jobs_delete_its_row,
    a_dependent_enqueued_while_a_prune_runs_keeps_its_dependency_every_round,
    a_chain_whose_middle_died_keeps_its_inputs_through_prunes_racing_its_revival,
);

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

/// In each of 100 rounds a workflow has two completed jobs, one in queue `x{round}` and one
/// in `y{round}`; two threads prune those two queues at once (`DeleteAll`). Both jobs go, so
/// the workflow's row must go with the last of them. Found by the attack on issue 32's
/// promise ("a workflow's row goes with its last job"): each prune deletes its job and then
/// `EMPTY_WORKFLOWS` looks for jobs left in the workflow, under READ COMMITTED, and sees the
/// other prune's job, deleted but not yet committed: neither deletes the row, and no later
/// prune looks at it again (only the workflows of the jobs a prune deletes are looked at).
/// A workflow row is left with no job (PostgreSQL). On MariaDB the two prunes deadlock
/// instead (the subquery locks the other prune's row), and the error reaches the caller
/// (prune does not retry it): retried here; a prune that then skips the job still held by
/// the other returns 0, and a prune after the round takes it.
fn concurrent_prunes_of_a_workflows_last_jobs_delete_its_row(backend: Backend) {
    const ROUNDS: usize = 100;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for round in 0..ROUNDS {
        let mut workflow = jobs::Workflow::new(format!("w{round}"));
        workflow.add(NewJob::new(format!("x{round}"), "a", vec![]));
        workflow.add(NewJob::new(format!("y{round}"), "a", vec![]));
        jobs::enqueue_workflow(&mut conn, &workflow).unwrap();
        for queue in [format!("x{round}"), format!("y{round}")] {
            let job = claim_one(&mut conn, &queue, "a");
            jobs::complete(&mut conn, &[job.claim()]).unwrap();
        }
    }
    let orphans = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = orphans.clone();
    let deadlocks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let retried = deadlocks.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, c| {
            let queue = if thread == 0 {
                format!("x{round}")
            } else {
                format!("y{round}")
            };
            // A deadlock between the two (MariaDB) is the caller's to retry: retried here.
            let mut deadlocks = 0;
            loop {
                match jobs::prune(c, &queue, Finished::Completed, Retention::DeleteAll, 100) {
                    Err(e) if e.is_retryable() && deadlocks < 20 => deadlocks += 1,
                    other => return (other, deadlocks),
                }
            }
        },
        move |round, results| {
            for (r, deadlocks) in &results {
                // 0: a retried prune skipped the job the other one still held; it stays for
                // the next prune (below).
                assert!(matches!(r, Ok(0 | 1)), "round {round}: {results:?}");
                retried.fetch_add(*deadlocks, std::sync::atomic::Ordering::SeqCst);
            }
            for queue in [format!("x{round}"), format!("y{round}")] {
                jobs::prune(
                    &mut conn,
                    &queue,
                    Finished::Completed,
                    Retention::DeleteAll,
                    100,
                )
                .unwrap();
            }
            assert_eq!(
                count(
                    &mut conn,
                    "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue LIKE 'x%' OR queue LIKE 'y%'"
                ) as usize,
                2 * (ROUNDS - round - 1)
            );
            let left = count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_workflows w WHERE NOT EXISTS \
                 (SELECT 1 FROM tenure_jobs j WHERE j.workflow_id = w.id)",
            );
            seen.lock().unwrap().push(left);
        },
    );
    let orphans = orphans.lock().unwrap();
    let last = *orphans.last().unwrap();
    assert_eq!(
        last,
        0,
        "{last} of {ROUNDS} workflows kept their row after both their jobs were pruned by \
         two prunes at once ({} prunes failed on a deadlock and were retried)",
        deadlocks.load(std::sync::atomic::Ordering::SeqCst)
    );
}

/// Like `prune_racing_an_enqueue_of_a_dependent_never_deletes_its_dependency`, but every round
/// races over its own dependency A (its own queue), so every round is a race (there, the first
/// round's prune deletes every A, and the later rounds' enqueues are all refused), with the
/// enqueue started a little later each round (0 to 1.2 ms) to sweep the prune's window. A
/// belongs to a workflow (the dependent joins it). The dependent enqueued must find A (and
/// A's result) until it finishes.
fn a_dependent_enqueued_while_a_prune_runs_keeps_its_dependency_every_round(backend: Backend) {
    const ROUNDS: usize = 120;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut done = Vec::new();
    for round in 0..ROUNDS {
        let mut workflow = jobs::Workflow::new(format!("w{round}"));
        workflow.add(NewJob::new(format!("a{round}"), "a", vec![]));
        jobs::enqueue_workflow(&mut conn, &workflow).unwrap();
        let job = claim_one(&mut conn, &format!("a{round}"), "a");
        jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json(&round).unwrap())
            .unwrap();
        done.push(job.id);
    }
    let done = Arc::new(done);
    let shared = done.clone();
    let broken = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = broken.clone();
    let enqueued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = enqueued.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, c| {
            if thread == 0 {
                std::thread::sleep(std::time::Duration::from_micros((round % 25) as u64 * 50));
                let job = NewJob::new("d", "d", vec![]).depends_on([shared[round]]);
                jobs::enqueue(c, &job).map(|e| e.id)
            } else {
                jobs::prune(
                    c,
                    &format!("a{round}"),
                    Finished::Completed,
                    Retention::DeleteAll,
                    10,
                )
                .map(|n| n as i64)
            }
        },
        move |round, results| {
            let a = done[round];
            assert!(results[1].is_ok(), "round {round}: prune {:?}", results[1]);
            match &results[0] {
                Ok(d) => {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let inputs = jobs::dependency_results(&mut conn, *d).unwrap().len();
                    if jobs::get(&mut conn, a).unwrap().is_none() || inputs != 1 {
                        seen.lock().unwrap().push((round, a, *d, inputs));
                    }
                }
                Err(e) => assert!(e.is_invalid_input(), "round {round}: enqueue {e}"),
            }
        },
    );
    let broken = broken.lock().unwrap();
    assert!(
        broken.is_empty(),
        "{} of {} dependents enqueued lost their dependency to the prune racing them \
         (round, A, D, inputs): {:?}",
        broken.len(),
        enqueued.load(std::sync::atomic::Ordering::SeqCst),
        &broken[..broken.len().min(5)]
    );
}

/// Chains A -> B -> C, 40 of them. A completes with a result, B dies (C is cancelled). In
/// each round one thread revives the round's B (`retry_dead`, or `retry_dead_of_kind` on the
/// round's own queue every other round) while another prunes completed and cancelled jobs
/// of that queue: whatever the order, a revived B finds A's result.
fn a_chain_whose_middle_died_keeps_its_inputs_through_prunes_racing_its_revival(backend: Backend) {
    const ROUNDS: usize = 40;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut bs = Vec::new();
    for round in 0..ROUNDS {
        let q = format!("c{round}");
        let a = enqueue(&mut conn, NewJob::new(q.clone(), "a", vec![]));
        let b = enqueue(
            &mut conn,
            NewJob::new(q.clone(), "b", vec![]).depends_on([a]),
        );
        let c = enqueue(
            &mut conn,
            NewJob::new(q.clone(), "c", vec![]).depends_on([b]),
        );
        let job = claim_one(&mut conn, &q, "a");
        jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json(&round).unwrap())
            .unwrap();
        let job = claim_one(&mut conn, &q, "b");
        jobs::fail(&mut conn, job.claim(), "boom", jobs::Retry::Never).unwrap();
        assert_eq!(state(&mut conn, b), JobState::Dead);
        assert_eq!(state(&mut conn, c), JobState::Cancelled);
        bs.push(b);
    }
    let bs = Arc::new(bs);
    let shared = bs.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, c| {
            let q = format!("c{round}");
            if thread == 0 {
                if round % 2 == 0 {
                    jobs::retry_dead(c, shared[round]).map(usize::from)
                } else {
                    jobs::retry_dead_of_kind(c, &q, "b")
                }
            } else {
                let n = jobs::prune(c, &q, Finished::Completed, Retention::DeleteAll, 10)?;
                Ok(n + jobs::prune(c, &q, Finished::Cancelled, Retention::DeleteAll, 10)?)
            }
        },
        move |round, results| {
            assert_eq!(
                results[0].as_ref().ok(),
                Some(&1),
                "round {round}: {results:?}"
            );
            assert!(results[1].is_ok(), "round {round}: {results:?}");
            let b = bs[round];
            let job = claim_one(&mut conn, &format!("c{round}"), "b");
            assert_eq!(job.id, b);
            let inputs = jobs::dependency_results(&mut conn, b).unwrap();
            assert_eq!(
                inputs.len(),
                1,
                "round {round}: the revived B reads no result of A"
            );
            assert!(inputs[0].result.is_some(), "round {round}: A's result gone");
            jobs::complete(&mut conn, &[job.claim()]).unwrap();
        },
    );
}

//! Second round of attacks on workflows: finishers holding rows of higher id than a
//! dependent they settle (a batch completion or a rescue against `cancel_workflow` and
//! against an enqueue), `retry_dead_of_kind` re-arming a dependent spread over several
//! stripes against a completion, and `retry_dead` against completions, repeated.

use std::sync::Arc;
use std::time::Duration;

use diesel::Connection;

use tenure::jobs::{self, JobState, NewJob, Outcome, RunWhen, Workflow};
use tenure::{Backend, Error};

use crate::common::{
    TestDb, claim_one, conformance, contest, count, enqueue_id as enqueue, job_state as state,
    wait_for_db_clock,
};

conformance!(
    a_batch_completion_settling_a_step_of_lower_id_does_not_deadlock_cancel_workflow,
    a_rescue_settling_a_step_of_lower_id_does_not_deadlock_cancel_workflow,
    a_batch_completion_settling_a_dependent_of_lower_id_does_not_deadlock_an_enqueue,
    retry_dead_of_kind_rearming_two_stripes_does_not_deadlock_a_completion,
    retry_dead_racing_the_last_other_dependency_never_strands_the_dependent,
    retry_then_death_then_retry_keeps_an_all_finished_dependent_waiting,
);

const TTL: Duration = Duration::from_secs(120);

/// E (external) has 300 dependents, then a workflow whose step S waits for E and whose step
/// X (id above S's) runs. A finisher completes [E, X]: it holds E's and X's rows while it
/// settles E's 300 dependents, then S (id below X). Meanwhile `cancel_workflow` locks the
/// workflow's jobs in id order: S, then waits for X. The completion then waits for S: a
/// cycle. Both calls must succeed.
fn a_batch_completion_settling_a_step_of_lower_id_does_not_deadlock_cancel_workflow(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let e = enqueue(&mut conn, NewJob::new("e", "e", vec![]));
    let fan: Vec<NewJob> = (0..300)
        .map(|_| NewJob::new("y", "y", vec![]).depends_on([e]))
        .collect();
    jobs::enqueue_many(&mut conn, &fan).unwrap();
    let mut flow = Workflow::new("w");
    flow.add(NewJob::new("w", "s", vec![]).depends_on([e]));
    flow.add(NewJob::new("w", "x", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    let (s, x) = (made.jobs[0], made.jobs[1]);
    assert!(e < s && s < x);
    assert_eq!(state(&mut conn, s), JobState::Blocked);
    let claims = vec![
        claim_one(&mut conn, "e", "e").claim(),
        claim_one(&mut conn, "w", "x").claim(),
    ];
    let workflow = made.id;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let (mut c1, mut c2) = (db.connect(), db.connect());
    let b1 = barrier.clone();
    let completer = std::thread::spawn(move || {
        b1.wait();
        jobs::complete(&mut c1, &claims)
    });
    let canceller = std::thread::spawn(move || {
        barrier.wait();
        std::thread::sleep(Duration::from_millis(40));
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

/// As above, with the rescue as the finisher: E (external, 300 dependents) and the step X
/// (id above the step S that waits for E) are both stalled, E asked to cancel. The rescue
/// locks E and X, cancels E and settles its dependents, S last; `cancel_workflow` holds S
/// and waits for X. The rescue's errors count as failures: both must succeed.
fn a_rescue_settling_a_step_of_lower_id_does_not_deadlock_cancel_workflow(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let e = enqueue(&mut conn, NewJob::new("e", "e", vec![]));
    let fan: Vec<NewJob> = (0..300)
        .map(|_| NewJob::new("y", "y", vec![]).depends_on([e]))
        .collect();
    jobs::enqueue_many(&mut conn, &fan).unwrap();
    let mut flow = Workflow::new("w");
    flow.add(NewJob::new("w", "s", vec![]).depends_on([e]));
    flow.add(NewJob::new("w", "x", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    let (s, x) = (made.jobs[0], made.jobs[1]);
    assert!(e < s && s < x);
    let short = Duration::from_secs(1);
    let job_e = jobs::claim_kinds(&mut conn, "e", &["e"], 1, short).unwrap();
    let job_x = jobs::claim_kinds(&mut conn, "w", &["x"], 1, short).unwrap();
    assert_eq!((job_e.len(), job_x.len()), (1, 1));
    assert!(jobs::cancel(&mut conn, e).unwrap());
    let lapse = job_e[0].claim_expires_at.max(job_x[0].claim_expires_at);
    wait_for_db_clock(&mut conn, lapse);
    let workflow = made.id;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let (mut c1, mut c2) = (db.connect(), db.connect());
    let b1 = barrier.clone();
    let rescuer = std::thread::spawn(move || {
        b1.wait();
        jobs::rescue(&mut c1, 100)
    });
    let canceller = std::thread::spawn(move || {
        barrier.wait();
        std::thread::sleep(Duration::from_millis(40));
        jobs::cancel_workflow(&mut c2, workflow)
    });
    let rescued = rescuer.join().unwrap();
    let cancelled = canceller.join().unwrap();
    assert!(
        rescued.is_ok() && cancelled.is_ok(),
        "rescue: {rescued:?}; cancel_workflow: {cancelled:?}"
    );
    assert_eq!(state(&mut conn, e), JobState::Cancelled);
    assert_eq!(state(&mut conn, s), JobState::Cancelled);
    assert!(jobs::claim(&mut conn, "w", 10, TTL).unwrap().is_empty());
}

/// A finisher completes [E, X] (E has 300 dependents, then D blocked on E, then X): it holds
/// X's row while it settles D, of lower id. An enqueue of a job that depends on [D, X]
/// locks D, then waits for X. Both must succeed, and the new job waits for D.
fn a_batch_completion_settling_a_dependent_of_lower_id_does_not_deadlock_an_enqueue(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let e = enqueue(&mut conn, NewJob::new("e", "e", vec![]));
    let fan: Vec<NewJob> = (0..300)
        .map(|_| NewJob::new("y", "y", vec![]).depends_on([e]))
        .collect();
    jobs::enqueue_many(&mut conn, &fan).unwrap();
    let d = enqueue(&mut conn, NewJob::new("d", "d", vec![]).depends_on([e]));
    let x = enqueue(&mut conn, NewJob::new("x", "x", vec![]));
    let claims = vec![
        claim_one(&mut conn, "e", "e").claim(),
        claim_one(&mut conn, "x", "x").claim(),
    ];
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let (mut c1, mut c2) = (db.connect(), db.connect());
    let b1 = barrier.clone();
    let completer = std::thread::spawn(move || {
        b1.wait();
        jobs::complete(&mut c1, &claims)
    });
    let enqueuer = std::thread::spawn(move || {
        barrier.wait();
        std::thread::sleep(Duration::from_millis(40));
        jobs::enqueue(&mut c2, &NewJob::new("n", "n", vec![]).depends_on([d, x])).map(|e| e.id)
    });
    let completed = completer.join().unwrap();
    let enqueued = enqueuer.join().unwrap();
    assert!(
        completed.is_ok() && enqueued.is_ok(),
        "complete: {completed:?}; enqueue: {enqueued:?}"
    );
    assert_eq!(state(&mut conn, d), JobState::Waiting);
    assert_eq!(state(&mut conn, enqueued.unwrap()), JobState::Blocked);
}

/// C (AllFinished) waits for 17 jobs, spread over 2 stripes (even positions in stripe 0,
/// odd in stripe 1). Stripe 0 is done (d0 dead, the rest completed); stripe 1 waits for d15
/// only (d1 dead). `retry_dead_of_kind` retries d0 and d1: it re-arms stripe 0 (which takes
/// C's row, the stripe having been empty), then stripe 1. A completion of d15 takes stripe 1
/// and then C's row. Another transaction holding C's row for a moment lines them up. Both
/// must succeed, and C must wait for d0 and d1.
fn retry_dead_of_kind_rearming_two_stripes_does_not_deadlock_a_completion(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let deps: Vec<i64> = (0..17)
        .map(|i| {
            let kind = if i < 2 { "x" } else { "o" };
            enqueue(&mut conn, NewJob::new("q", kind, vec![]))
        })
        .collect();
    let c = enqueue(
        &mut conn,
        NewJob::new("c", "c", vec![])
            .depends_on(deps.clone())
            .run_when(RunWhen::AllFinished),
    );
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_dependency_stripes WHERE job_id = {c}")
        ),
        2
    );
    for job in jobs::claim_kinds(&mut conn, "q", &["x"], 10, TTL).unwrap() {
        jobs::fail(&mut conn, job.claim(), "boom", jobs::Retry::Never).unwrap();
    }
    let others = jobs::claim_kinds(&mut conn, "q", &["o"], 100, TTL).unwrap();
    let mut last = None;
    for job in others {
        if job.id == deps[15] {
            last = Some(job);
        } else {
            jobs::complete(&mut conn, &[job.claim()]).unwrap();
        }
    }
    let last = last.unwrap();
    assert_eq!(state(&mut conn, c), JobState::Blocked);
    let mut blocker = db.connect();
    let (retried, completed) = blocker
        .transaction::<_, Error, _>(|b| {
            if backend != Backend::Sqlite {
                count(
                    b,
                    &format!("SELECT id AS n FROM tenure_jobs WHERE id = {c} FOR UPDATE"),
                );
            }
            let mut c1 = db.connect();
            let retrier = std::thread::spawn(move || jobs::retry_dead_of_kind(&mut c1, "q", "x"));
            std::thread::sleep(Duration::from_millis(300));
            let mut c2 = db.connect();
            let completer = std::thread::spawn(move || jobs::complete(&mut c2, &[last.claim()]));
            std::thread::sleep(Duration::from_millis(300));
            Ok((retrier, completer))
        })
        .unwrap();
    let retried = retried.join().unwrap();
    let completed = completed.join().unwrap();
    assert!(
        retried.is_ok() && completed.is_ok(),
        "retry_dead_of_kind: {retried:?}; complete: {completed:?}"
    );
    assert_eq!(retried.unwrap(), 2);
    assert_eq!(
        state(&mut conn, c),
        JobState::Blocked,
        "C released while d0 and d1 run again"
    );
    for job in jobs::claim_kinds(&mut conn, "q", &["x"], 10, TTL).unwrap() {
        jobs::complete(&mut conn, &[job.claim()]).unwrap();
    }
    assert_eq!(state(&mut conn, c), JobState::Waiting);
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

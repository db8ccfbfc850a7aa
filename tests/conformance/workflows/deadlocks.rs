//! Workflows' lock orders: `cancel_workflow`, `enqueue_many`, rescues and `retry_dead_of_kind`
//! racing completions that settle dependents of lower id never deadlock.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use diesel::Connection;
use tenure::jobs::{self, JobState, NewJob, RunWhen, Workflow};
use tenure::{Backend, Error};

use crate::common::{
    TestDb, claim_one, conformance, count, enqueue_id as enqueue, job_state as state,
    wait_for_db_clock,
};

conformance!(
    cancel_workflow_racing_a_batch_completion_does_not_deadlock,
    enqueue_many_racing_a_completion_does_not_deadlock,
    a_batch_completion_settling_a_step_of_lower_id_does_not_deadlock_cancel_workflow,
    a_rescue_settling_a_step_of_lower_id_does_not_deadlock_cancel_workflow,
    a_batch_completion_settling_a_dependent_of_lower_id_does_not_deadlock_an_enqueue,
    retry_dead_of_kind_rearming_two_stripes_does_not_deadlock_a_completion,
);

const TTL: Duration = Duration::from_secs(120);

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

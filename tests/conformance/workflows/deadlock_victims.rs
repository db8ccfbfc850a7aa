//! A finisher chosen as a deadlock victim: its transaction retried releases each dependent
//! exactly once, and MariaDB's locking read waiting mid-fetch does not hang.

use std::sync::mpsc;
use std::time::Duration;

use diesel::RunQueryDsl;
use tenure::jobs::{self, JobState, NewJob, Outcome};
use tenure::{Backend, Error};

use crate::common::{
    TestDb, claim_one, conformance, count, enqueue_id as enqueue, job_state as state,
};

conformance!(
    a_batch_completion_waiting_mid_fetch_in_a_deadlock_with_cancels_does_not_hang,
    a_completion_retried_after_a_deadlock_releases_each_dependent_exactly_once,
);

const TTL: Duration = Duration::from_secs(120);

/// A worker completes [A, B] (both running) in one call: its locking read of their rows
/// (`LOCK_STATES`, no lock taken ahead by an UPDATE) locks A, then waits for B, which a
/// caller's transaction holds (it asked B to cancel). That transaction then asks A to
/// cancel: a deadlock, whose victim (on MariaDB the one that changed nothing yet: the
/// completion) is waiting in the middle of its locking read. The completion must come back
/// (retried: both jobs then asked to cancel, so both Cancelled), not hang. On MariaDB the
/// retry runs the same prepared read again, which the client had left expecting the rest of
/// the failed result: without `mysql::forget_failed_statements` it waits forever (issue 32
/// item 8's stall).
fn a_batch_completion_waiting_mid_fetch_in_a_deadlock_with_cancels_does_not_hang(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let b = enqueue(&mut conn, NewJob::new("q", "b", vec![]));
    assert!(a < b);
    let claims = vec![
        claim_one(&mut conn, "q", "a").claim(),
        claim_one(&mut conn, "q", "b").claim(),
    ];
    let (locked_tx, locked_rx) = mpsc::channel::<()>();
    let mut user = db.connect();
    let canceller = std::thread::spawn(move || {
        tenure::transaction(&mut user, |c| {
            assert!(jobs::cancel(c, b)?);
            locked_tx.send(()).unwrap();
            // The completion is now waiting for B's lock, holding A's.
            std::thread::sleep(Duration::from_millis(500));
            jobs::cancel(c, a)
        })
    });
    locked_rx.recv().unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    let mut worker = db.connect();
    std::thread::spawn(move || {
        let _ = done_tx.send(jobs::complete(&mut worker, &claims));
    });
    // The caller's transaction ends (committed, or rolled back as the victim) either way.
    let cancelled: Result<bool, Error> = canceller.join().unwrap();
    let completed = done_rx
        .recv_timeout(Duration::from_secs(40))
        .unwrap_or_else(|_| {
            panic!(
                "the batch completion hung (a locking read waiting mid-fetch, deadlock victim); \
             the caller's transaction, long over, returned {cancelled:?}"
            )
        });
    match (&completed, &cancelled) {
        (Ok(outcomes), Ok(true)) => {
            assert_eq!(outcomes, &vec![Outcome::Cancelled, Outcome::Cancelled]);
            assert_eq!(state(&mut conn, a), JobState::Cancelled);
            assert_eq!(state(&mut conn, b), JobState::Cancelled);
        }
        // The caller's transaction was the victim (its error is the caller's to retry): the
        // completion went on, after it rolled back.
        (Ok(outcomes), Err(e)) if e.is_retryable() => {
            assert_eq!(outcomes, &vec![Outcome::Done, Outcome::Done]);
            assert_eq!(state(&mut conn, a), JobState::Completed);
            assert_eq!(state(&mut conn, b), JobState::Completed);
        }
        other => panic!("completion and cancels: {other:?}"),
    }
}

/// E has dependents R < S, and X (id above S) runs. A worker completes [E, X]: it locks E
/// and X, releases R, then counts S down and waits for S's row, which a caller's
/// transaction holds; that transaction then writes X's row: a deadlock. Where the
/// completion is the victim (PostgreSQL: it waited first) its transaction is rolled back,
/// release of R included, and run again: R and S must each be released exactly once (their
/// stripes at zero, not below), every edge counted once, and the outcomes Done.
fn a_completion_retried_after_a_deadlock_releases_each_dependent_exactly_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let e = enqueue(&mut conn, NewJob::new("e", "e", vec![]));
    let r = enqueue(&mut conn, NewJob::new("r", "r", vec![]).depends_on([e]));
    let s = enqueue(&mut conn, NewJob::new("s", "s", vec![]).depends_on([e]));
    let x = enqueue(&mut conn, NewJob::new("x", "x", vec![]));
    assert!(e < r && r < s && s < x);
    let claims = vec![
        claim_one(&mut conn, "e", "e").claim(),
        claim_one(&mut conn, "x", "x").claim(),
    ];
    let (locked_tx, locked_rx) = mpsc::channel::<()>();
    let mut user = db.connect();
    let holder = std::thread::spawn(move || {
        tenure::transaction(&mut user, |c| {
            diesel::sql_query(format!(
                "UPDATE tenure_jobs SET priority = priority + 1 WHERE id = {s}"
            ))
            .execute(c)?;
            locked_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(500));
            diesel::sql_query(format!(
                "UPDATE tenure_jobs SET priority = priority + 1 WHERE id = {x}"
            ))
            .execute(c)?;
            Ok::<_, Error>(())
        })
    });
    locked_rx.recv().unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    let mut worker = db.connect();
    std::thread::spawn(move || {
        let _ = done_tx.send(jobs::complete(&mut worker, &claims));
    });
    let completed = done_rx
        .recv_timeout(Duration::from_secs(40))
        .expect("the completion hung");
    let held = holder.join().unwrap();
    if let Err(e) = &held {
        assert!(e.is_retryable(), "the caller's transaction: {e}");
    }
    if backend == Backend::Postgres {
        // The completion waited first: it is the victim, and was run again.
        assert!(held.is_ok(), "the caller's transaction failed: {held:?}");
    }
    assert_eq!(
        completed.unwrap(),
        vec![Outcome::Done, Outcome::Done],
        "the outcomes of the attempt that committed"
    );
    assert_eq!(state(&mut conn, e), JobState::Completed);
    assert_eq!(state(&mut conn, x), JobState::Completed);
    assert_eq!(state(&mut conn, r), JobState::Waiting);
    assert_eq!(state(&mut conn, s), JobState::Waiting);
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_job_dependencies WHERE depends_on = {e} AND counted = 1"
            )
        ),
        2
    );
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT CAST(COALESCE(SUM(pending), 0) AS BIGINT) AS n FROM tenure_dependency_stripes \
                 WHERE job_id IN ({r}, {s})"
            )
            .replace(
                "AS BIGINT",
                if backend == Backend::Mysql { "AS SIGNED" } else { "AS BIGINT" }
            )
        ),
        0
    );
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT CAST(COALESCE(SUM(stripes_pending), 0) AS BIGINT) AS n FROM tenure_jobs \
                 WHERE id IN ({r}, {s})"
            )
            .replace(
                "AS BIGINT",
                if backend == Backend::Mysql {
                    "AS SIGNED"
                } else {
                    "AS BIGINT"
                }
            )
        ),
        0
    );
    // One release each: claimable once.
    let mut claimed = jobs::claim_kinds(&mut conn, "r", &["r"], 10, TTL).unwrap();
    claimed.extend(jobs::claim_kinds(&mut conn, "s", &["s"], 10, TTL).unwrap());
    assert_eq!(claimed.len(), 2);
}

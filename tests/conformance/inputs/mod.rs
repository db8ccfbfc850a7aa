//! Inputs at the edges: instants past year 9999, a dedup counter past 2^31, migrations raced
//! by `schema_version`, a lease guard released inside its own verify transaction, and
//! connections killed mid-call.

mod instants;

use std::sync::mpsc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use diesel::connection::SimpleConnection;
use tenure::jobs::{self, Enqueued, JobState, NewJob, Outcome, Retry};
use tenure::{Backend, Error, LeaseGuard, lease};

use crate::common::{TestDb, conformance, count, poll_until, race, wait_until};

conformance!(
    instants_outside_years_1_to_9999_are_refused_before_any_statement,
    dedup_hits_count_past_two_to_the_31,
    schema_version_and_migrations_race_on_fresh_databases_without_errors,
    releasing_a_guard_inside_its_verify_transaction_does_not_hang,
    a_guard_released_on_the_callers_connection_commits_with_the_work,
    a_connection_killed_while_waiting_for_a_row_lock_is_outcome_unknown,
);

const TTL: Duration = Duration::from_secs(60);

/// Generous: none of these waits is expected to come near it, however loaded the machine.
const BOUND: Duration = Duration::from_secs(20);

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

fn instants_outside_years_1_to_9999_are_refused_before_any_statement(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let outside = [
        DateTime::<Utc>::MAX_UTC,
        utc(10000, 1, 1, 0, 0, 0),
        DateTime::<Utc>::MIN_UTC,
        utc(0, 12, 31, 23, 59, 59),
    ];
    for at in outside {
        let err = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).at(at)).unwrap_err();
        assert!(err.is_invalid_input(), "{at}: {err:?}");
        let batch = [
            NewJob::new("q", "k", vec![]),
            NewJob::new("q", "k", vec![]).at(at),
        ];
        let err = jobs::enqueue_many(&mut conn, &batch).unwrap_err();
        assert!(err.is_invalid_input(), "{at}: {err:?}");
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);

    // The ends of the range are stored as given (to the millisecond, SQLite's resolution)
    // and keep their order.
    let first = utc(1, 1, 1, 0, 0, 0);
    let last = utc(9999, 12, 31, 23, 59, 59) + chrono::Duration::milliseconds(999);
    let early = jobs::enqueue(&mut conn, &NewJob::new("q", "early", vec![]).at(first)).unwrap();
    let late = jobs::enqueue(&mut conn, &NewJob::new("q", "late", vec![]).at(last)).unwrap();
    assert_eq!(
        jobs::get(&mut conn, early.id).unwrap().unwrap().due_at,
        first
    );
    assert_eq!(jobs::get(&mut conn, late.id).unwrap().unwrap().due_at, last);
    let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![early.id],
        "only the job due in year 1 is due"
    );
    jobs::stats(&mut conn).expect("stats read every stored instant");

    // A retry "never" as a far instant is refused, and the claim is left as it was.
    let job = &claimed[0];
    for at in outside {
        let err = jobs::fail(&mut conn, job.claim(), "boom", Retry::At(at)).unwrap_err();
        assert!(err.is_invalid_input(), "{at}: {err:?}");
    }
    let stored = jobs::get(&mut conn, job.id).unwrap().unwrap();
    assert_eq!(stored.state, JobState::Running);
    assert_eq!(stored.last_error, None);
    assert_eq!(
        jobs::renew(&mut conn, &[job.claim()], TTL).unwrap(),
        vec![Outcome::Done],
        "the claim is still this token's"
    );

    // The latest instant is a retry that waits.
    assert_eq!(
        jobs::fail(&mut conn, job.claim(), "boom", Retry::At(last)).unwrap(),
        Outcome::Done
    );
    let stored = jobs::get(&mut conn, job.id).unwrap().unwrap();
    assert_eq!((stored.state, stored.due_at), (JobState::Waiting, last));
    assert!(jobs::claim(&mut conn, "q", 10, TTL).unwrap().is_empty());
    jobs::stats(&mut conn).expect("stats read every stored instant");
}

fn dedup_hits_count_past_two_to_the_31(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = NewJob::new("q", "k", vec![]).dedup_key("same");
    let first = jobs::enqueue(&mut conn, &job).unwrap();
    assert!(!first.existing);
    conn.batch_execute(&format!(
        "UPDATE tenure_jobs SET dedup_hits = 2147483646 WHERE id = {}",
        first.id
    ))
    .unwrap();
    for n in 0..3 {
        let again = jobs::enqueue(&mut conn, &job)
            .unwrap_or_else(|e| panic!("duplicate {n} past 2^31 - 2: {e}"));
        assert_eq!(
            again,
            Enqueued {
                id: first.id,
                existing: true,
                updated: false,
            },
            "duplicate {n} past 2^31 - 2"
        );
    }
    assert_eq!(
        count(&mut conn, "SELECT dedup_hits AS n FROM tenure_jobs"),
        2_147_483_649
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 1);
}

/// Six threads on fresh databases, half migrating, half asking for the schema version, all
/// at once: no errors, and every round ends at the same newest version. Rounds: 20 on
/// SQLite; 8 on a server, where each round's migrations are some forty DDL statements
/// (MariaDB commits each on its own): 20 rounds took 33 s of a suite under load and passed
/// nextest's 60 s when MariaDB alone was loaded.
fn schema_version_and_migrations_race_on_fresh_databases_without_errors(backend: Backend) {
    let rounds = if backend == Backend::Sqlite { 20 } else { 8 };
    const THREADS: usize = 6;
    let mut errors = Vec::new();
    let mut newest = None;
    for round in 0..rounds {
        let db = TestDb::empty(backend);
        // Half migrate, half ask for the version, all at once on their own connections.
        let results = race(&db, THREADS, |i, conn| {
            if i % 2 == 0 {
                tenure::run_migrations(conn).map(|_| ())
            } else {
                tenure::schema_version(conn).map(|_| ())
            }
        });
        errors.extend(
            results
                .into_iter()
                .filter_map(Result::err)
                .map(|e| format!("round {round}: {e}")),
        );
        let version = tenure::schema_version(&mut db.connect()).unwrap();
        assert!(version.is_some(), "round {round}: the schema was migrated");
        if let Some(newest) = &newest {
            assert_eq!(&version, newest, "round {round}");
        }
        newest = Some(version);
    }
    assert!(
        errors.is_empty(),
        "{} errors in {rounds} rounds: {errors:#?}",
        errors.len()
    );
}

/// Runs `f` on a thread of its own and returns its result, failing the test if it has not
/// returned within [`BOUND`] (the thread is left behind: a regression must not hang the suite).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    receiver
        .recv_timeout(BOUND)
        .unwrap_or_else(|e| panic!("{what} did not return within {BOUND:?}: {e}"))
}

fn releasing_a_guard_inside_its_verify_transaction_does_not_hang(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "verified", TTL, "guard")
        .unwrap()
        .expect("the lease is free");
    let mut conn = pool.get().unwrap();
    let outcome = bounded("a release inside the verify transaction", move || {
        tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            // The row is locked by this transaction until it commits.
            Ok::<_, Error>(guard.release())
        })
    });
    let err = outcome
        .expect("the transaction commits")
        .expect_err("the release cannot be done before the transaction ends");
    assert!(matches!(err, Error::LeaseReleasePending { .. }), "{err:?}");
    // Nothing is lost: with the transaction over, the release completes on its own.
    let mut conn = db.connect();
    poll_until(BOUND, Duration::from_millis(20), || {
        (!lease::inspect(&mut conn, "verified").unwrap().unwrap().held).then_some(())
    })
    .expect("the pending release never completed");
}

fn a_guard_released_on_the_callers_connection_commits_with_the_work(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "work", TTL, "guard")
        .unwrap()
        .expect("the lease is free");
    let fence = guard.fence();
    let mut conn = pool.get().unwrap();
    let released = bounded("a release on the caller's connection", move || {
        tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            jobs::enqueue(conn, &NewJob::new("q", "result", vec![]))?;
            guard.release_on(conn)
        })
    });
    assert!(released.unwrap(), "it was still the guard's to release");
    let mut conn = db.connect();
    assert!(!lease::inspect(&mut conn, "work").unwrap().unwrap().held);
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 1);
    let next = lease::try_take(&mut conn, "work", TTL, "next")
        .unwrap()
        .expect("released at the commit");
    assert!(next.fence() > fence);

    // Rolled back with the work: the lease stays taken (until its ttl; no more renewals).
    let guard = LeaseGuard::try_take_pooled(&pool, "undone", TTL, "guard")
        .unwrap()
        .expect("the lease is free");
    let mut conn = pool.get().unwrap();
    let outcome = bounded("a release on the caller's connection", move || {
        tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            assert!(guard.release_on(conn)?);
            Err::<(), _>(Error::Timeout { what: "the test" })
        })
    });
    assert!(matches!(outcome, Err(Error::Timeout { .. })), "{outcome:?}");
    let mut conn = db.connect();
    assert!(lease::inspect(&mut conn, "undone").unwrap().unwrap().held);
}

fn a_connection_killed_while_waiting_for_a_row_lock_is_outcome_unknown(backend: Backend) {
    if backend == Backend::Sqlite {
        return; // no server, no KILL
    }
    let db = TestDb::migrated(backend);
    let mut holder = db.connect();
    let mut victim = db.connect();
    let mut admin = db.connect();
    let victim_id = count(
        &mut victim,
        match backend {
            Backend::Postgres => "SELECT CAST(pg_backend_pid() AS BIGINT) AS n",
            _ => "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n",
        },
    );
    let waiting = match backend {
        Backend::Postgres => format!(
            "SELECT COUNT(*) AS n FROM pg_stat_activity \
             WHERE pid = {victim_id} AND wait_event_type = 'Lock'"
        ),
        // (Not innodb_trx: MariaDB refreshes that cache only when no one read it for 0.1 s.)
        _ => format!(
            "SELECT COUNT(*) AS n FROM information_schema.processlist \
             WHERE id = {victim_id} AND info LIKE 'UPDATE tenure_leases%'"
        ),
    };
    let kill = match backend {
        Backend::Postgres => format!("SELECT pg_terminate_backend({victim_id})"),
        _ => format!("KILL {victim_id}"),
    };
    let lease = lease::try_take(&mut holder, "locked", TTL, "holder")
        .unwrap()
        .expect("the lease is free");
    let mut killed = None;
    tenure::transaction(&mut holder, |holder| {
        lease.verify(holder)?;
        // The victim waits for the row this transaction locked, and is killed meanwhile.
        killed = Some(std::thread::scope(|s| {
            let victim = s.spawn(|| lease::force_release(&mut victim, "locked"));
            wait_until("the victim to wait for the lock", BOUND, || {
                (count(&mut admin, &waiting) > 0).then_some(())
            });
            admin.batch_execute(&kill).unwrap();
            victim.join().expect("the victim thread")
        }));
        Ok::<_, Error>(())
    })
    .unwrap();
    let err = killed
        .expect("the victim ran")
        .expect_err("the killed call succeeded");
    assert!(err.is_outcome_unknown(), "{err:?}");
    // The connection is unusable afterwards: an error, never a success.
    assert!(lease::force_release(&mut victim, "locked").is_err());
}

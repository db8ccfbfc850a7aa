//! Error classes: a lock wait timeout is retryable, not outcome-unknown; a commit or a call on a
//! connection killed (mid-transaction or idle) is outcome-unknown, never "nothing there".

use std::sync::mpsc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, NewJob};
use tenure::schedules::{self};
use tenure::{AnyConnection, Backend, Error, lease};

use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    a_lock_wait_timeout_is_retryable_not_outcome_unknown,
    a_commit_on_a_killed_connection_is_outcome_unknown,
    a_call_on_a_connection_killed_while_idle_is_outcome_unknown,
);

/// Generous: none of these waits is expected to come near it, however loaded the machine.
const BOUND: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

/// A call that gives up waiting for a row lock (PostgreSQL lock_timeout, MariaDB
/// innodb_lock_wait_timeout, SQLite busy_timeout) is retryable, and not "outcome unknown":
/// the connection is fine and nothing was applied.
fn a_lock_wait_timeout_is_retryable_not_outcome_unknown(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut holder = db.connect();
    let mut waiter = match backend {
        Backend::Sqlite => db.connect_with(
            &tenure::SessionSetup::default().busy_timeout(Duration::from_millis(200)),
        ),
        _ => db.connect(),
    };
    match backend {
        Backend::Postgres => waiter.batch_execute("SET lock_timeout = '300ms'").unwrap(),
        Backend::Mysql => waiter
            .batch_execute("SET SESSION innodb_lock_wait_timeout = 1")
            .unwrap(),
        Backend::Sqlite => {}
    }
    let lease = lease::try_take(&mut holder, "locked", TTL, "holder")
        .unwrap()
        .expect("free");
    let (sender, receiver) = mpsc::channel();
    tenure::transaction(&mut holder, |holder| {
        lease.verify(holder)?;
        if backend == Backend::Sqlite {
            // Make sure this transaction holds SQLite's write lock.
            jobs::enqueue(holder, &NewJob::new("q", "k", vec![]))?;
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let _ = sender.send(lease::force_release(&mut waiter, "locked"));
            });
            let outcome = receiver
                .recv_timeout(BOUND)
                .expect("the waiter gave up in time");
            let err = outcome.expect_err("the waiter got through a held row lock");
            assert!(
                err.is_retryable(),
                "a lock wait timeout is not retryable: {err:?}"
            );
            assert!(!err.is_outcome_unknown(), "{err:?}");
        });
        Ok::<_, Error>(())
    })
    .unwrap();
    // The connection is usable, and the lease still held.
    assert!(lease::inspect(&mut waiter, "locked").unwrap().unwrap().held);
}

/// The server-side id of a connection, and SQL that kills it and says whether it is gone.
fn killer(backend: Backend, victim: &mut AnyConnection) -> (String, String) {
    let id = count(
        victim,
        match backend {
            Backend::Postgres => "SELECT CAST(pg_backend_pid() AS BIGINT) AS n",
            _ => "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n",
        },
    );
    match backend {
        Backend::Postgres => (
            format!("SELECT pg_terminate_backend({id})"),
            format!("SELECT COUNT(*) AS n FROM pg_stat_activity WHERE pid = {id}"),
        ),
        _ => (
            format!("KILL {id}"),
            format!("SELECT COUNT(*) AS n FROM information_schema.processlist WHERE id = {id}"),
        ),
    }
}

fn kill_and_wait(admin: &mut AnyConnection, kill: &str, alive: &str) {
    admin.batch_execute(kill).unwrap();
    poll_until(BOUND, Duration::from_millis(20), || {
        (count(admin, alive) == 0).then_some(())
    })
    .expect("the victim never went away");
}

/// The connection is killed inside a caller's tenure::transaction (after verify and some work),
/// so the COMMIT is sent on a dead connection: the caller cannot know whether the work
/// committed, and the error must say so (is_outcome_unknown).
fn a_commit_on_a_killed_connection_is_outcome_unknown(backend: Backend) {
    if backend == Backend::Sqlite {
        return; // no server, no KILL
    }
    let db = TestDb::migrated(backend);
    let mut victim = db.connect();
    let mut admin = db.connect();
    let (kill, alive) = killer(backend, &mut victim);
    let lease = lease::try_take(&mut victim, "l", TTL, "me")
        .unwrap()
        .expect("free");
    let err = tenure::transaction(&mut victim, |conn| {
        lease.verify(conn)?;
        jobs::enqueue(conn, &NewJob::new("q", "k", vec![]))?;
        kill_and_wait(&mut admin, &kill, &alive);
        Ok::<_, Error>(())
    })
    .expect_err("a commit on a killed connection succeeded");
    assert!(
        err.is_outcome_unknown(),
        "a lost COMMIT is not outcome-unknown: {err:?}"
    );
    // The next call on that connection is refused before it sends anything (on PostgreSQL
    // diesel's BrokenTransactionManager): it says to try again on a new connection, never
    // a plain failure. Found by issue 32's review (issue 14's note).
    let err = jobs::enqueue(&mut victim, &NewJob::new("q", "k", vec![]))
        .expect_err("a call on the killed connection succeeded");
    assert!(
        err.is_retryable() || err.is_outcome_unknown(),
        "the call after a lost COMMIT is neither retryable nor outcome-unknown: {err:?}"
    );
    let mut fresh = db.connect();
    assert_eq!(
        lease::inspect(&mut fresh, "l").unwrap().map(|l| l.held),
        Some(true)
    );
}

/// A connection killed while idle, then used by a tenure call: the call fails as outcome
/// unknown (the client cannot tell how far the statement got).
fn a_call_on_a_connection_killed_while_idle_is_outcome_unknown(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let db = TestDb::migrated(backend);
    let mut victim = db.connect();
    let mut admin = db.connect();
    let (kill, alive) = killer(backend, &mut victim);
    kill_and_wait(&mut admin, &kill, &alive);
    let err = jobs::enqueue(&mut victim, &NewJob::new("q", "k", vec![]))
        .expect_err("an enqueue on a killed connection succeeded");
    assert!(err.is_outcome_unknown(), "{err:?}");
    // A scheduler's connection killed while idle: its first tick after.
    let mut scheduler = db.connect();
    let (kill, alive) = killer(backend, &mut scheduler);
    kill_and_wait(&mut admin, &kill, &alive);
    let err = schedules::tick(&mut scheduler).expect_err("a tick on a killed connection");
    assert!(err.is_outcome_unknown(), "tick: {err:?}");
}

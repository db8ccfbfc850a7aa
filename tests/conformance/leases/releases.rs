//! Releasing a lease that was lost (it spares the new holder, and says so promptly), and a
//! guard dropped inside its own verify transaction.

use std::sync::mpsc;
use std::time::Duration;

use tenure::jobs::{self, NewJob};
use tenure::{Backend, Error, LeaseGuard, lease};

use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    release_on_after_the_lease_was_lost_returns_false_and_spares_the_new_holder,
    release_after_the_lease_was_lost_returns_false_promptly,
    dropping_a_guard_inside_its_verify_transaction_does_not_hang,
);

/// Generous: none of these waits is expected to come near it, however loaded the machine.
const BOUND: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    receiver
        .recv_timeout(BOUND)
        .unwrap_or_else(|e| panic!("{what} did not return within {BOUND:?}: {e}"))
}

/// A guard whose lease was force-released and taken by someone else: release_on, in the
/// caller's transaction, says false and leaves the new holder's lease alone.
fn release_on_after_the_lease_was_lost_returns_false_and_spares_the_new_holder(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "lost", TTL, "first")
        .unwrap()
        .expect("free");
    let mut other = db.connect();
    assert!(lease::force_release(&mut other, "lost").unwrap());
    let thief = lease::try_take(&mut other, "lost", TTL, "second")
        .unwrap()
        .expect("free after the force release");
    let mut conn = pool.get().unwrap();
    let released = bounded("release_on after a loss", move || {
        tenure::transaction(&mut conn, |conn| {
            jobs::enqueue(conn, &NewJob::new("q", "k", vec![]))?;
            guard.release_on(conn)
        })
    });
    assert!(
        !released.expect("the transaction commits"),
        "it was no longer the guard's"
    );
    let info = lease::inspect(&mut other, "lost").unwrap().unwrap();
    assert!(info.held, "the new holder's lease was released: {info:?}");
    thief
        .verify(&mut other)
        .expect("the new holder still holds it");
    assert_eq!(
        count(&mut other, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        1
    );
}

/// release() of a guard whose lease was lost returns false, well within the release wait.
fn release_after_the_lease_was_lost_returns_false_promptly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "lost", TTL, "first")
        .unwrap()
        .expect("free");
    let mut other = db.connect();
    assert!(lease::force_release(&mut other, "lost").unwrap());
    let thief = lease::try_take(&mut other, "lost", TTL, "second")
        .unwrap()
        .expect("free");
    let released = bounded("release after a loss", move || guard.release());
    assert!(!released.expect("no error"), "it was no longer the guard's");
    thief
        .verify(&mut other)
        .expect("the new holder still holds it");
}

/// Dropping a guard inside the transaction that verified its lease releases like release():
/// it must not hang either.
fn dropping_a_guard_inside_its_verify_transaction_does_not_hang(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "dropped", TTL, "guard")
        .unwrap()
        .expect("the lease is free");
    let mut conn = pool.get().unwrap();
    bounded("a drop inside the verify transaction", move || {
        tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            drop(guard);
            Ok::<_, Error>(())
        })
    })
    .expect("the transaction commits");
    let mut conn = db.connect();
    poll_until(BOUND, Duration::from_millis(20), || {
        (!lease::inspect(&mut conn, "dropped").unwrap().unwrap().held).then_some(())
    })
    .expect("the dropped guard's lease stays held");
}

//! The line at its edges: a caller asking another number of holders, a waiter whose place
//! lapsed, a dead waiter ahead, waits of zero and of `Duration::MAX`, and (PostgreSQL) no
//! LISTEN left on a pooled connection.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant as Clock};

use tenure::lease::{self, Take, Wait};
use tenure::{AnyConnection, Backend, LeaseGuard};

use super::line::{in_line, until_in_line};
use crate::common::{TestDb, conformance, count, wait_for_db_clock};

conformance!(
    a_try_take_asking_another_n_does_not_overtake_a_waiter,
    a_waiter_whose_place_lapsed_is_not_served_before_a_live_waiter,
    a_zero_first_pause_does_not_spin,
    a_wait_of_duration_max_does_not_panic,
    a_poll_interval_of_duration_max_does_not_panic,
    a_dead_waiter_ahead_holds_the_line_only_until_its_place_lapses,
);

const LONG: Duration = Duration::from_secs(120);
const HOUR: Duration = Duration::from_secs(3600);
const TEN_MINUTES: Duration = Duration::from_secs(600);

/// Promise 3: a try_take never overtakes a live waiter. A waiter for a lease of one holder
/// stands in line (alive: its place is renewed for 100 minutes); the holder lapses; a
/// try_take asking for 1 holder is refused (the control), but one asking for 3 is granted,
/// and the waiter, woken, gets `LeaseHoldersMismatch` instead of the lease.
fn a_try_take_asking_another_n_does_not_overtake_a_waiter(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let holder = Take::new("n", Duration::from_millis(500), "h")
        .on(&mut conn)
        .unwrap()
        .expect("free");
    let (tx, rx) = mpsc::channel();
    let mut waiter_conn = db.connect();
    std::thread::spawn(move || {
        let take = Take::new("n", LONG, "waiter").wait(
            Wait::up_to(LONG)
                .poll_interval(TEN_MINUTES)
                .first_pause(TEN_MINUTES),
        );
        let _ = tx.send(take.on(&mut waiter_conn).map(|l| l.map(|l| l.fence())));
    });
    until_in_line(&mut conn, "n", 1);
    wait_for_db_clock(&mut conn, holder.expires_at());
    // The control: the same N is not granted over the waiter.
    assert!(
        lease::try_take(&mut conn, "n", LONG, "poller")
            .unwrap()
            .is_none(),
        "a try_take of the same N must not overtake the waiter"
    );
    let mut other = db.connect();
    let overtaker = Take::new("n", LONG, "poller of 3")
        .holders(3)
        .on(&mut other);
    // Wake the waiter (a release anywhere in this process wakes every waiter).
    let _ = lease::force_release(&mut conn, "unrelated");
    let waiter = rx.recv_timeout(Duration::from_secs(60));
    // Refused: not granted, or told the name keeps its number of holders while anyone waits.
    assert!(
        matches!(
            overtaker,
            Ok(None)
                | Err(tenure::Error::LeaseHoldersMismatch {
                    holders: 1,
                    asked: 3,
                    ..
                })
        ),
        "a try_take asking for 3 holders was granted over a live waiter in line: {:?}; the \
         waiter then got {waiter:?}",
        overtaker.map(|l| l.map(|l| (l.slot(), l.fence())))
    );
    assert!(
        matches!(waiter, Ok(Ok(Some(fence))) if fence > holder.fence()),
        "the waiter is served: {waiter:?}"
    );
}

static W1_CHECKS: AtomicUsize = AtomicUsize::new(0);

/// The first time it is asked, stalls 7 s (a GC pause, a stopped process): longer than the
/// waiter's place lasts (5 s).
fn stall_once() -> bool {
    if W1_CHECKS.fetch_add(1, Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_secs(7));
    }
    false
}

/// A waiter whose place lapsed rejoins at the end. W1 joins first, then stalls past its
/// place's ttl; W2 joins behind it and stays alive (it renews its place at its 100 ms polls).
/// The holder lapses: W2 is served first, not W1, whose lapsed place no longer counts.
fn a_waiter_whose_place_lapsed_is_not_served_before_a_live_waiter(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let holder = Take::new("q", Duration::from_secs(2), "h")
        .on(&mut conn)
        .unwrap()
        .expect("free");
    let (tx, rx) = mpsc::channel();
    let mut w1_conn = db.connect();
    let w1 = tx.clone();
    std::thread::spawn(move || {
        let take = Take::new("q", LONG, "w1").wait(
            Wait::up_to(LONG)
                .poll_interval(Duration::from_millis(100))
                .cancel_when(stall_once),
        );
        let got = take.on(&mut w1_conn);
        let _ = w1.send(("w1", got.map(|l| l.map(|l| l.fence())), Clock::now()));
    });
    until_in_line(&mut conn, "q", 1);
    let mut w2_conn = db.connect();
    std::thread::spawn(move || {
        let take = Take::new("q", LONG, "w2")
            .wait(Wait::up_to(LONG).poll_interval(Duration::from_millis(100)));
        let got = take.on(&mut w2_conn);
        let _ = tx.send(("w2", got.map(|l| l.map(|l| l.fence())), Clock::now()));
    });
    until_in_line(&mut conn, "q", 2);
    wait_for_db_clock(&mut conn, holder.expires_at());
    let (who, got, _) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("someone is served");
    let w2_waiting = in_line(&mut conn, "q");
    assert!(
        who != "w1",
        "w1, whose place had lapsed while it stalled, was granted ({got:?}) while w2, alive \
         and behind it only before the lapse, still stood in line ({w2_waiting} in line)"
    );
}

static ATTEMPTS: AtomicUsize = AtomicUsize::new(0);

fn count_attempts() -> bool {
    ATTEMPTS.fetch_add(1, Ordering::SeqCst);
    false
}

/// Promise 7 (zero poll intervals are refused, not run): `Wait::first_pause(ZERO)` is
/// accepted, and the backoff (which doubles the pause) stays at zero: the waiter makes
/// attempts back to back, a transaction each, for its whole wait.
fn a_zero_first_pause_does_not_spin(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let _held = lease::try_take(&mut conn, "spin", LONG, "h")
        .unwrap()
        .unwrap();
    let mut waiter = db.connect();
    let wait = Wait::up_to(Duration::from_secs(3))
        .poll_interval(Duration::from_millis(100))
        .first_pause(Duration::ZERO)
        .cancel_when(count_attempts);
    let outcome = Take::new("spin", LONG, "w").wait(wait).on(&mut waiter);
    let attempts = ATTEMPTS.load(Ordering::SeqCst);
    match outcome {
        Err(e) => assert!(e.is_invalid_input(), "{e:?}"),
        Ok(got) => {
            assert!(got.is_none());
            // Pauses of 50-100 ms over 3 s: about 40 attempts; 100 is a wide margin.
            assert!(
                attempts <= 100,
                "{attempts} attempts in a 3 s wait polling every 100 ms at most (first pause \
                 zero was accepted and never grows)"
            );
        }
    }
}

/// Promise 8: no panics in library code. `Wait::up_to(Duration::MAX)` (wait "forever") adds
/// the timeout to `Instant::now()`.
fn a_wait_of_duration_max_does_not_panic(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Take::new("forever", LONG, "w")
            .wait(Wait::up_to(Duration::MAX))
            .on(&mut conn)
            .map(|l| l.is_some())
    }));
    assert!(
        outcome.is_ok(),
        "a take waiting up to Duration::MAX panicked"
    );
}

/// Promise 8 (and 7): `Wait::poll_interval(Duration::MAX)` must be refused with a typed
/// error, not panic (the place's ttl is ten poll intervals).
fn a_poll_interval_of_duration_max_does_not_panic(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Take::new("poll", LONG, "w")
            .wait(Wait::up_to(Duration::from_secs(1)).poll_interval(Duration::MAX))
            .on(&mut conn)
            .map(|l| l.is_some())
    }));
    assert!(
        outcome.is_ok(),
        "a take polling every Duration::MAX panicked"
    );
    assert!(
        outcome.unwrap().unwrap_err().is_invalid_input(),
        "refused as bad input"
    );
}

/// Set once the dying waiter has made its one attempt.
static DEAD: AtomicBool = AtomicBool::new(false);

/// A waiter that stops for good after its first attempt: a process that died, as far as the
/// line can tell (it never renews its place again).
fn die() -> bool {
    if !DEAD.swap(true, Ordering::SeqCst) {
        loop {
            std::thread::sleep(HOUR);
        }
    }
    false
}

/// Promise 3: a waiter ahead that died does not block the line forever: once its place
/// lapses (5 s), the next waiter is served, within the place's ttl and a few polls.
fn a_dead_waiter_ahead_holds_the_line_only_until_its_place_lapses(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut holder = lease::try_take(&mut conn, "d", LONG, "h").unwrap().unwrap();
    let mut dead_conn = db.connect();
    std::thread::spawn(move || {
        let _ = Take::new("d", LONG, "dead")
            .wait(
                Wait::up_to(HOUR)
                    .poll_interval(Duration::from_millis(100))
                    .cancel_when(die),
            )
            .on(&mut dead_conn);
    });
    until_in_line(&mut conn, "d", 1);
    let (tx, rx) = mpsc::channel();
    let mut next_conn = db.connect();
    std::thread::spawn(move || {
        let got = Take::new("d", LONG, "next")
            .wait(Wait::up_to(LONG).poll_interval(Duration::from_millis(100)))
            .on(&mut next_conn)
            .map(|l| l.map(|l| l.fence()));
        let _ = tx.send((got, Clock::now()));
    });
    until_in_line(&mut conn, "d", 2);
    let released = Clock::now();
    assert!(holder.release(&mut conn).unwrap());
    let (got, at) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the waiter behind a dead one is served within 60 s");
    assert!(matches!(got, Ok(Some(_))), "{got:?}");
    let after = at - released;
    // The dead waiter's place was renewed just before; it lapses 5 s later.
    assert!(
        after < Duration::from_secs(30),
        "served {after:?} after the release"
    );
    println!("{backend}: served {after:?} after the release, behind a dead waiter");
}

/// Promise 8 on PostgreSQL: a pooled connection used for a waiting take comes back without a
/// lingering LISTEN, whether the take timed out, succeeded, errored, or panicked.
#[cfg(feature = "postgres")]
mod listen {
    use super::*;

    fn channels(conn: &mut AnyConnection) -> i64 {
        count(conn, "SELECT COUNT(*) AS n FROM pg_listening_channels()")
    }

    #[test]
    fn postgres_a_waiting_take_leaves_no_listen_after_timeout_success_or_error() {
        let db = TestDb::migrated(Backend::Postgres);
        let pool = db.pool(1);
        let mut other = db.connect();
        let _held = lease::try_take(&mut other, "busy", LONG, "h")
            .unwrap()
            .unwrap();
        let wait = Wait::up_to(Duration::from_millis(300));
        // Timed out.
        {
            let mut conn = pool.get().unwrap();
            let got = Take::new("busy", LONG, "w")
                .wait(wait)
                .on(&mut conn)
                .unwrap();
            assert!(got.is_none());
        }
        assert_eq!(channels(&mut pool.get().unwrap()), 0, "after a timeout");
        // Succeeded.
        {
            let mut conn = pool.get().unwrap();
            let got = Take::new("free", LONG, "w")
                .wait(wait)
                .on(&mut conn)
                .unwrap();
            assert!(got.is_some());
        }
        assert_eq!(channels(&mut pool.get().unwrap()), 0, "after a grant");
        // Errored: another number of holders.
        {
            let mut conn = pool.get().unwrap();
            let err = Take::new("busy", LONG, "w")
                .holders(2)
                .wait(wait)
                .on(&mut conn)
                .unwrap_err();
            assert!(
                matches!(err, tenure::Error::LeaseHoldersMismatch { .. }),
                "{err:?}"
            );
        }
        assert_eq!(channels(&mut pool.get().unwrap()), 0, "after a mismatch");
        // Errored: inside a transaction, committed.
        {
            let mut conn = pool.get().unwrap();
            let _ = tenure::transaction(&mut conn, |c| {
                let e = Take::new("busy", LONG, "w")
                    .wait(wait)
                    .on(c)
                    .map(|l| l.is_some());
                assert!(e.is_err());
                Ok::<_, tenure::Error>(())
            });
        }
        assert_eq!(
            channels(&mut pool.get().unwrap()),
            0,
            "after a take in a transaction"
        );
        // A guard's waiting take.
        {
            let guard = LeaseGuard::take_pooled_as(&pool, &Take::new("busy", LONG, "w").wait(wait))
                .unwrap();
            assert!(guard.is_none());
        }
        assert_eq!(
            channels(&mut pool.get().unwrap()),
            0,
            "after a guard's take"
        );
    }

    #[test]
    fn postgres_a_waiting_take_that_panics_leaves_no_listen() {
        let db = TestDb::migrated(Backend::Postgres);
        let pool = db.pool(1);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut conn = pool.get().unwrap();
            let _ = Take::new("x", LONG, "w")
                .wait(Wait::up_to(Duration::MAX))
                .on(&mut conn);
        }))
        .is_err();
        let listening = channels(&mut pool.get().unwrap());
        assert_eq!(
            listening, 0,
            "the pooled connection came back LISTENing (the take panicked: {panicked})"
        );
    }
}

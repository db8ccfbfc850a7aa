//! Waiting in line for a lease: waiters are granted in the order they joined, pollers
//! (`try_take`) cannot overtake them, a waiter that gives up leaves the line, and a release
//! wakes the next waiter (in this process on every backend; from another session by NOTIFY
//! on PostgreSQL) long before its next poll.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant as Clock};

use diesel::prelude::*;
use diesel::sql_types::Text;
use tenure::lease::{self, Take, Wait};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count, now_sql, placeholders, poll_until};

conformance!(
    waiters_are_granted_in_the_order_they_joined,
    pollers_cannot_overtake_a_waiter,
    a_waiter_that_gives_up_leaves_the_line,
    releases_wake_the_next_waiter_before_its_next_poll,
);

const LONG: Duration = Duration::from_secs(120);

/// How many callers stand in line for `name` (lapsed places included).
pub(super) fn in_line(conn: &mut AnyConnection, name: &str) -> i64 {
    count(
        conn,
        &format!("SELECT COUNT(*) AS n FROM tenure_lease_waiters WHERE name = '{name}'"),
    )
}

/// Waits until `n` callers stand in line for `name`.
pub(super) fn until_in_line(conn: &mut AnyConnection, name: &str, n: i64) {
    poll_until(LONG, Duration::from_millis(5), || {
        (in_line(conn, name) >= n).then_some(())
    })
    .unwrap_or_else(|| panic!("{n} waiters never stood in line for {name}"));
}

/// A waiter thread: waits in line for `name` (up to LONG, polling every `poll`), reports its
/// grant with its number, holds it `hold`, releases.
fn waiter(
    db: &TestDb,
    name: &str,
    number: usize,
    poll: Duration,
    hold: Duration,
    granted: mpsc::Sender<(usize, i64)>,
) -> std::thread::JoinHandle<()> {
    let mut conn = db.connect();
    let take = Take::new(name, LONG, &format!("waiter {number}"))
        .wait(Wait::up_to(LONG).poll_interval(poll).first_pause(poll));
    std::thread::spawn(move || {
        let mut held = take.on(&mut conn).expect("no error").expect("served");
        let _ = granted.send((number, held.fence()));
        std::thread::sleep(hold);
        held.release(&mut conn).expect("release");
    })
}

/// 8 waiters join one after another behind a holder; released, the lease passes through
/// them in the order they joined.
fn waiters_are_granted_in_the_order_they_joined(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut first = lease::try_take(&mut conn, "fifo", LONG, "first")
        .unwrap()
        .expect("free");
    let (granted, grants) = mpsc::channel();
    let mut threads = Vec::new();
    for number in 0..8 {
        threads.push(waiter(
            &db,
            "fifo",
            number,
            Duration::from_millis(20),
            Duration::from_millis(5),
            granted.clone(),
        ));
        until_in_line(&mut conn, "fifo", number as i64 + 1);
    }
    assert!(first.release(&mut conn).unwrap());
    let order: Vec<usize> = (0..8)
        .map(|_| grants.recv_timeout(LONG).expect("a grant").0)
        .collect();
    for thread in threads {
        thread.join().expect("a waiter panicked");
    }
    assert_eq!(order, (0..8).collect::<Vec<_>>());
    assert_eq!(in_line(&mut conn, "fifo"), 0, "the line is empty");
}

/// A waiter stands in line while 4 threads poll `try_take` as fast as they can; when the
/// holder releases, the waiter gets the lease, and no poller got it before.
fn pollers_cannot_overtake_a_waiter(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut first = lease::try_take(&mut conn, "line", LONG, "first")
        .unwrap()
        .expect("free");
    let (granted, grants) = mpsc::channel();
    let waiting = waiter(&db, "line", 0, Duration::from_millis(20), LONG, granted);
    until_in_line(&mut conn, "line", 1);
    let stop = Arc::new(AtomicBool::new(false));
    let polls = Arc::new(AtomicUsize::new(0));
    let won = Arc::new(Mutex::new(Vec::new()));
    let pollers: Vec<_> = (0..4)
        .map(|i| {
            let mut conn = db.connect();
            let (stop, polls, won) = (stop.clone(), polls.clone(), won.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match lease::try_take(&mut conn, "line", LONG, &format!("poller {i}")) {
                        Ok(Some(mut lease)) => {
                            won.lock().unwrap().push(lease.fence());
                            let _ = lease.release(&mut conn);
                        }
                        Ok(None) => {}
                        Err(e) if e.is_retryable() => {}
                        Err(e) => panic!("poller {i}: {e:?}"),
                    }
                    polls.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    // The pollers are at it before the release.
    poll_until(LONG, Duration::from_millis(5), || {
        (polls.load(Ordering::SeqCst) >= 20).then_some(())
    })
    .expect("the pollers poll");
    assert!(first.release(&mut conn).unwrap());
    let (_, fence) = grants.recv_timeout(LONG).expect("the waiter is served");
    stop.store(true, Ordering::SeqCst);
    for poller in pollers {
        poller.join().expect("a poller panicked");
    }
    let won = won.lock().unwrap();
    assert!(
        won.is_empty(),
        "pollers took the lease before the waiter: {won:?}"
    );
    assert_eq!(fence, first.fence() + 1, "the waiter had the next grant");
    drop(waiting); // holds for LONG: the test ends without it
}

/// A waiter whose wait ends leaves the line at once: the next caller is not held behind
/// its place until the place lapses.
fn a_waiter_that_gives_up_leaves_the_line(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut first = lease::try_take(&mut conn, "brief", LONG, "first")
        .unwrap()
        .expect("free");
    let mut other = db.connect();
    let gave_up = Take::new("brief", LONG, "impatient")
        .wait(Wait::up_to(Duration::from_millis(300)))
        .on(&mut other)
        .unwrap();
    assert!(gave_up.is_none());
    assert_eq!(in_line(&mut conn, "brief"), 0);
    assert!(first.release(&mut conn).unwrap());
    assert!(
        lease::try_take(&mut conn, "brief", LONG, "next")
            .unwrap()
            .is_some(),
        "nobody waits: a try_take is granted"
    );
}

/// Waiters that poll only every 10 minutes are woken by releases: a chain of 4 waiters,
/// each holding for a moment, is served within a minute of the first release (without the
/// wake-ups, the first would wait about 10). Released
/// through the library in this process (all backends), and on PostgreSQL also by another
/// session's release and NOTIFY alone (nothing in this process wakes them then).
fn releases_wake_the_next_waiter_before_its_next_poll(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let rare = Duration::from_secs(600);
    let mut first = lease::try_take(&mut conn, "woken", LONG, "first")
        .unwrap()
        .expect("free");
    let (granted, grants) = mpsc::channel();
    let mut threads = Vec::new();
    for number in 0..4 {
        threads.push(waiter(
            &db,
            "woken",
            number,
            rare,
            Duration::from_millis(5),
            granted.clone(),
        ));
        until_in_line(&mut conn, "woken", number as i64 + 1);
    }
    let released = Clock::now();
    assert!(first.release(&mut conn).unwrap());
    for _ in 0..4 {
        grants.recv_timeout(LONG).expect("a grant");
    }
    let took = released.elapsed();
    for thread in threads {
        thread.join().expect("a waiter panicked");
    }
    assert!(took < Duration::from_secs(60), "served in {took:?}");

    if backend != Backend::Postgres {
        return;
    }
    // Another session releases with SQL and NOTIFY, as another process would: only the
    // notification can wake the waiter.
    let held = lease::try_take(&mut conn, "notified", LONG, "first")
        .unwrap()
        .expect("free");
    let (granted, grants) = mpsc::channel();
    let thread = waiter(&db, "notified", 0, rare, Duration::from_millis(5), granted);
    until_in_line(&mut conn, "notified", 1);
    let released = Clock::now();
    let sql = format!(
        "UPDATE tenure_leases SET token = NULL, reusable_at = {} WHERE name = {}",
        now_sql(backend),
        placeholders(backend, 1)
    );
    let mut outside = db.connect();
    diesel::sql_query(sql)
        .bind::<Text, _>("notified")
        .execute(&mut outside)
        .unwrap();
    diesel::sql_query("SELECT pg_notify('tenure_leases', 'notified')")
        .execute(&mut outside)
        .unwrap();
    let (_, fence) = grants.recv_timeout(LONG).expect("a grant");
    assert!(fence > held.fence());
    thread.join().expect("the waiter panicked");
    let took = released.elapsed();
    assert!(took < Duration::from_secs(60), "served in {took:?}");
}

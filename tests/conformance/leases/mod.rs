//! Leases: fencing, renewal, release, eviction, waiting takes, the clock, names and bad
//! input; the race the reference report describes and the guard in files of their own.

mod guard;
mod holders;
mod leadership;
mod line;
mod line_edges;
mod races;
mod releases;
mod semaphore;
mod slots;
mod takeover;
mod takeover_edges;
mod terms;

use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use tenure::lease::{self, Wait};
use tenure::{AnyConnection, Backend, Error, LeaseGuard, TenureConnection};

use crate::common::{TestDb, concrete, conformance, count, placeholders};

conformance!(
    a_stalled_holder_is_taken_over_and_refused_everything,
    renewal_after_lapse_is_lost_and_repeated_renewal_succeeds,
    release_is_idempotent_and_a_late_release_changes_nothing,
    force_release_evicts_the_holder,
    verify_commits_work_only_under_a_held_lease,
    take_with_wait_times_out_and_wakes_after_release,
    expiry_follows_the_clock_inside_long_transactions,
    names_that_differ_in_case_or_spaces_are_different_leases,
    bad_input_is_refused_and_writes_nothing,
);

const LONG: Duration = Duration::from_secs(60);

/// The lease row as stored, token included.
#[derive(QueryableByName, Debug, PartialEq)]
struct RawLease {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Nullable<tenure::sql_types::Token>)]
    token: Option<uuid::Uuid>,
    #[diesel(sql_type = Text)]
    holder: String,
    #[diesel(sql_type = BigInt)]
    fence: i64,
    #[diesel(sql_type = tenure::sql_types::Instant)]
    acquired_at: DateTime<Utc>,
    #[diesel(sql_type = tenure::sql_types::Instant)]
    expires_at: DateTime<Utc>,
}

fn raw_lease(conn: &mut AnyConnection, name: &str) -> RawLease {
    let sql = format!(
        "SELECT name, token, holder, fence, acquired_at, expires_at FROM tenure_leases WHERE name = {}",
        placeholders(conn.backend(), 1)
    );
    concrete!(conn, c => diesel::sql_query(sql).bind::<Text, _>(name).get_result(c))
        .expect("read the lease row")
}

fn a_stalled_holder_is_taken_over_and_refused_everything(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut a = db.connect();
    let mut b = db.connect();
    let mut stalled = lease::try_take(&mut a, "job", Duration::from_millis(200), "a")
        .unwrap()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let taker = lease::try_take(&mut b, "job", LONG, "b")
        .unwrap()
        .expect("the lapsed lease is free");
    assert!(taker.fence() > stalled.fence());
    let before = raw_lease(&mut b, "job");
    assert_eq!(before.token, Some(taker.token()));

    // A copy not yet marked lost locally, so the database itself must refuse it.
    let unaware = stalled.clone();
    let verify = tenure::transaction(&mut a, |c| unaware.verify(c)).unwrap_err();
    assert!(verify.is_lease_lost(), "{verify:?}");
    let renewed = stalled.renew(&mut a, LONG).unwrap_err();
    assert!(renewed.is_lease_lost(), "{renewed:?}");
    assert!(stalled.is_known_lost());
    assert!(!unaware.clone().release(&mut a).unwrap());

    assert_eq!(
        raw_lease(&mut b, "job"),
        before,
        "the new holder's row must not change"
    );
    tenure::transaction(&mut b, |c| taker.verify(c)).unwrap();
}

fn renewal_after_lapse_is_lost_and_repeated_renewal_succeeds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut held = lease::try_take(&mut conn, "r", Duration::from_millis(300), "me")
        .unwrap()
        .unwrap();
    let first = held.expires_at();
    held.renew(&mut conn, Duration::from_millis(300)).unwrap();
    let second = held.expires_at();
    held.renew(&mut conn, Duration::from_millis(300)).unwrap();
    assert!(first <= second && second <= held.expires_at());
    std::thread::sleep(Duration::from_millis(400));
    // Nobody took it, but it lapsed: lost, and it stays lost.
    assert!(held.renew(&mut conn, LONG).unwrap_err().is_lease_lost());
    assert!(held.renew(&mut conn, LONG).unwrap_err().is_lease_lost());
    assert!(held.verify(&mut conn).unwrap_err().is_lease_lost());
    let info = lease::inspect(&mut conn, "r").unwrap().unwrap();
    assert!(!info.held);
    assert!(info.now >= info.expires_at);
}

fn release_is_idempotent_and_a_late_release_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut a = lease::try_take(&mut conn, "rel", LONG, "a")
        .unwrap()
        .unwrap();
    assert!(lease::inspect(&mut conn, "rel").unwrap().unwrap().held);
    assert!(a.release(&mut conn).unwrap());
    assert!(!a.release(&mut conn).unwrap());
    let info = lease::inspect(&mut conn, "rel").unwrap().unwrap();
    assert!(!info.held);
    assert_eq!(info.fence, a.fence(), "the row and its fence stay");
    let b = lease::try_take(&mut conn, "rel", LONG, "b")
        .unwrap()
        .unwrap();
    assert_eq!(b.fence(), a.fence() + 1);
    let before = raw_lease(&mut conn, "rel");
    let mut late = a.clone();
    assert!(!late.release(&mut conn).unwrap());
    assert_eq!(raw_lease(&mut conn, "rel"), before);
    let listed = lease::list(&mut conn).unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].held && listed[0].holder == "b");
}

fn force_release_evicts_the_holder(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut held = lease::try_take(&mut conn, "ops", LONG, "worker")
        .unwrap()
        .unwrap();
    assert!(lease::force_release(&mut conn, "ops").unwrap());
    assert!(!lease::force_release(&mut conn, "ops").unwrap());
    assert!(!lease::force_release(&mut conn, "never-taken").unwrap());
    let info = lease::inspect(&mut conn, "ops").unwrap().unwrap();
    assert!(!info.held);
    assert_eq!(info.fence, held.fence());
    assert!(held.renew(&mut conn, LONG).unwrap_err().is_lease_lost());
    let next = lease::try_take(&mut conn, "ops", LONG, "next")
        .unwrap()
        .unwrap();
    assert_eq!(next.fence(), held.fence() + 1);
}

fn verify_commits_work_only_under_a_held_lease(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute("CREATE TABLE work (id INTEGER PRIMARY KEY)")
        .unwrap();
    let held = lease::try_take(&mut conn, "w", Duration::from_millis(300), "a")
        .unwrap()
        .unwrap();
    tenure::transaction(&mut conn, |c| {
        held.verify(c)?;
        c.batch_execute("INSERT INTO work (id) VALUES (1)")?;
        Ok::<_, Error>(())
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(400));
    let mut other = db.connect();
    lease::try_take(&mut other, "w", LONG, "b")
        .unwrap()
        .unwrap();
    let refused = tenure::transaction(&mut conn, |c| {
        c.batch_execute("INSERT INTO work (id) VALUES (2)")?;
        held.verify(c)?;
        Ok::<_, Error>(())
    })
    .unwrap_err();
    assert!(refused.is_lease_lost(), "{refused:?}");
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM work"), 1);
}

fn take_with_wait_times_out_and_wakes_after_release(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut holder_conn = db.connect();
    let mut holder = lease::try_take(&mut holder_conn, "wait", LONG, "holder")
        .unwrap()
        .unwrap();
    let poll = Duration::from_millis(50);
    let mut waiter = db.connect();
    let started = Clock::now();
    let none = lease::take(
        &mut waiter,
        "wait",
        LONG,
        "waiter",
        Wait::up_to(Duration::from_millis(300)).poll_interval(poll),
    )
    .unwrap();
    let waited = started.elapsed();
    assert!(none.is_none());
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );

    let background = std::thread::spawn(move || {
        let got = lease::take(
            &mut waiter,
            "wait",
            LONG,
            "waiter",
            Wait::up_to(Duration::from_secs(20)).poll_interval(poll),
        )
        .unwrap();
        (got, Clock::now())
    });
    std::thread::sleep(Duration::from_millis(500));
    let released_at = Clock::now();
    assert!(holder.release(&mut holder_conn).unwrap());
    let (got, woke_at) = background.join().unwrap();
    let got = got.expect("the waiter gets the lease after the release");
    assert!(got.fence() > holder.fence());
    let latency = woke_at - released_at;
    // Expected within one poll interval (50 ms); 10x margin.
    assert!(latency < poll * 10, "took {latency:?} after the release");
    println!(
        "{backend} take-with-wait woke {latency:?} after the release (poll interval {poll:?})"
    );
}

fn set_non_utc_session(conn: &mut AnyConnection) {
    match conn.backend() {
        Backend::Postgres => conn.batch_execute("SET TIME ZONE 'America/St_Johns'"),
        Backend::Mysql => conn.batch_execute("SET time_zone = '-03:30'"),
        Backend::Sqlite => Ok(()),
    }
    .unwrap();
}

fn expiry_follows_the_clock_inside_long_transactions(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut a = db.connect();
    let mut reader = db.connect();
    set_non_utc_session(&mut reader);
    // Taking needs a bare connection: inside a transaction it is refused, not deferred.
    let refused = a
        .transaction(|c| lease::try_take(c, "clock", LONG, "a"))
        .unwrap_err();
    assert!(
        matches!(refused, Error::InTransaction { .. }),
        "{refused:?}"
    );

    let held = lease::try_take(&mut a, "clock", Duration::from_millis(700), "a")
        .unwrap()
        .unwrap();
    let utc_view = lease::inspect(&mut a, "clock").unwrap().unwrap();
    let (early, late) = reader
        .transaction(|r| {
            let early = lease::inspect(r, "clock")?.expect("the row");
            // A transaction that began before the expiry and runs past it sees it expire:
            // its clock is not frozen at BEGIN.
            std::thread::sleep(Duration::from_millis(1000));
            let late = lease::inspect(r, "clock")?.expect("the row");
            let verified = held.verify(r);
            assert!(verified.unwrap_err().is_lease_lost());
            Ok::<_, Error>((early, late))
        })
        .unwrap();
    assert!(early.held && !late.held, "{early:?} {late:?}");
    assert!(late.now - early.now >= chrono::Duration::milliseconds(900));
    // A session in another time zone sees the same instants.
    assert_eq!(early.expires_at, utc_view.expires_at);
    assert_eq!(early.acquired_at, utc_view.acquired_at);
}

fn names_that_differ_in_case_or_spaces_are_different_leases(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let names = ["Job", "job", "job ", "jöb"];
    for name in names {
        let held = lease::try_take(&mut conn, name, LONG, "me").unwrap();
        assert!(held.is_some(), "{name:?} collided with another name");
        assert_eq!(held.unwrap().name(), name);
    }
    let listed: Vec<String> = lease::list(&mut conn)
        .unwrap()
        .into_iter()
        .map(|l| l.name)
        .collect();
    assert_eq!(listed.len(), names.len());
    for name in names {
        assert!(
            listed.iter().any(|l| l == name),
            "{name:?} missing from {listed:?}"
        );
        assert!(
            lease::try_take(&mut conn, name, LONG, "other")
                .unwrap()
                .is_none()
        );
    }
}

fn bad_input_is_refused_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let long_name = "n".repeat(256);
    let long_holder = "h".repeat(256);
    let attempts: Vec<(&str, &str, Duration, &str)> = vec![
        ("empty name", "", LONG, "h"),
        ("256-byte name", &long_name, LONG, "h"),
        ("NUL in name", "a\0b", LONG, "h"),
        ("zero ttl", "n", Duration::ZERO, "h"),
        ("sub-millisecond ttl", "n", Duration::from_micros(999), "h"),
        ("absurd ttl", "n", Duration::from_secs(400 * 86400), "h"),
        ("256-byte holder", "n", LONG, &long_holder),
        ("NUL in holder", "n", LONG, "h\0"),
    ];
    for (what, name, ttl, holder) in attempts {
        let err = lease::try_take(&mut conn, name, ttl, holder).unwrap_err();
        assert!(err.is_invalid_input(), "{what}: {err:?}");
        let err = lease::take(&mut conn, name, ttl, holder, Wait::up_to(LONG)).unwrap_err();
        assert!(err.is_invalid_input(), "{what} (take): {err:?}");
    }
    assert!(
        lease::force_release(&mut conn, "")
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        lease::inspect(&mut conn, &long_name)
            .unwrap_err()
            .is_invalid_input()
    );
    let zero_poll = Wait::up_to(LONG).poll_interval(Duration::ZERO);
    assert!(
        lease::take(&mut conn, "n", LONG, "h", zero_poll)
            .unwrap_err()
            .is_invalid_input()
    );
    let guard = LeaseGuard::try_take(db.connect(), "n", Duration::ZERO, "h");
    assert!(guard.unwrap_err().is_invalid_input());
    // A valid lease refuses a bad renewal ttl without touching the row.
    let mut held = lease::try_take(&mut conn, "ok", LONG, "h")
        .unwrap()
        .unwrap();
    let before = raw_lease(&mut conn, "ok");
    assert!(
        held.renew(&mut conn, Duration::ZERO)
            .unwrap_err()
            .is_invalid_input()
    );
    assert_eq!(raw_lease(&mut conn, "ok"), before);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_leases"),
        1
    );
}

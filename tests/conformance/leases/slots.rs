//! Holder slots at their edges: mixed operations never exceed N holders, a release after
//! the lapse keeps the lock delay, the migration keeps holders and fences of existing rows,
//! and bad input writes nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tenure::Backend;
use tenure::lease::{self, Leadership, Take, Wait};

use crate::common::{TestDb, conformance, count, wait_for_db_clock};

conformance!(
    a_release_after_the_lapse_does_not_cut_the_lock_delay,
    the_migration_keeps_holders_and_fences_of_existing_rows,
    bad_input_is_refused_and_writes_no_name_and_no_place,
    mixed_operations_never_exceed_n_holders_and_fences_grow,
);

const LONG: Duration = Duration::from_secs(120);
const HOUR: Duration = Duration::from_secs(3600);

/// Promise 4: after a lapse the slot is not granted before expiry + lock delay. A holder
/// whose lease lapsed (it was paused: its writes may still be in flight) and which then calls
/// `release` is told `true`, and the release sets `reusable_at` to now: the slot is granted at
/// once, an hour before its lock delay ends.
fn a_release_after_the_lapse_does_not_cut_the_lock_delay(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut paused = Take::new("delayed", Duration::from_millis(300), "paused")
        .lock_delay(HOUR)
        .on(&mut conn)
        .unwrap()
        .expect("free");
    wait_for_db_clock(&mut conn, paused.expires_at());
    // The control: lapsed, the slot is held back for the delay.
    assert!(
        lease::try_take(&mut conn, "delayed", LONG, "next")
            .unwrap()
            .is_none(),
        "the lock delay holds the lapsed slot"
    );
    // The paused holder wakes up and lets go of a lease it no longer held.
    let released = paused.release(&mut conn).unwrap();
    let info = lease::inspect(&mut conn, "delayed").unwrap().unwrap();
    let next = lease::try_take(&mut conn, "delayed", LONG, "next").unwrap();
    assert!(
        next.is_none(),
        "granted {:?} after the lapsed holder's release (which said {released}), though its \
         lock delay runs until {} (now {})",
        next.map(|l| l.fence()),
        paused.expires_at() + chrono::Duration::hours(1),
        info.now
    );
}

/// Promise 2 across the migration: rows of the one-holder schema (a held lease of fence 41, a
/// released one of fence 7) move to slot 0 with their fences; the held one stays held, and
/// the next grants get 42 and 8.
fn the_migration_keeps_holders_and_fences_of_existing_rows(backend: Backend) {
    use diesel::connection::SimpleConnection;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let (down, token) = match backend {
        Backend::Sqlite => (
            include_str!("../../../migrations/sqlite/tenure-0050_lease_holders/down.sql"),
            "randomblob(16)",
        ),
        Backend::Postgres => (
            include_str!("../../../migrations/postgres/tenure-0050_lease_holders/down.sql"),
            "gen_random_uuid()",
        ),
        Backend::Mysql => (
            include_str!("../../../migrations/mysql/tenure-0050_lease_holders/down.sql"),
            "RANDOM_BYTES(16)",
        ),
    };
    conn.batch_execute(down).unwrap();
    conn.batch_execute("DELETE FROM __diesel_schema_migrations WHERE version LIKE '%0050%'")
        .unwrap();
    conn.batch_execute(&format!(
        "INSERT INTO tenure_leases (name, token, holder, fence, acquired_at, expires_at) VALUES \
         ('held', {token}, 'old', 41, '2020-01-01 00:00:00.000', '2999-01-01 00:00:00.000'), \
         ('released', NULL, 'old', 7, '2020-01-01 00:00:00.000', '2020-01-01 00:00:01.000')"
    ))
    .unwrap();
    let applied = tenure::run_migrations(&mut conn).unwrap();
    assert!(applied.iter().any(|m| m.contains("0050")), "{applied:?}");
    assert!(
        lease::try_take(&mut conn, "held", LONG, "new")
            .unwrap()
            .is_none(),
        "a held lease stays held across the migration"
    );
    let released = lease::try_take(&mut conn, "released", LONG, "new")
        .unwrap()
        .expect("free");
    assert_eq!(released.fence(), 8);
    assert!(lease::force_release(&mut conn, "held").unwrap());
    let two = Take::new("held", LONG, "new").holders(2);
    let first = two
        .on(&mut conn)
        .unwrap()
        .expect("free after the force release");
    let second = two.on(&mut conn).unwrap().expect("a second slot");
    assert_eq!((first.fence(), second.fence()), (42, 43));
}

/// Promise 7: bad input gets a typed error and changes nothing: no row in
/// tenure_lease_names, tenure_lease_waiters or tenure_leases.
fn bad_input_is_refused_and_writes_no_name_and_no_place(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let wait = Wait::up_to(Duration::from_millis(200));
    let bad: Vec<(&str, Take)> = vec![
        ("0 holders", Take::new("bad", LONG, "h").holders(0)),
        ("1001 holders", Take::new("bad", LONG, "h").holders(1001)),
        (
            "u32::MAX holders",
            Take::new("bad", LONG, "h").holders(u32::MAX),
        ),
        (
            "sub-ms lock delay",
            Take::new("bad", LONG, "h").lock_delay(Duration::from_micros(500)),
        ),
        (
            "367-day lock delay",
            Take::new("bad", LONG, "h").lock_delay(Duration::from_secs(367 * 86400)),
        ),
        (
            "Duration::MAX lock delay",
            Take::new("bad", LONG, "h").lock_delay(Duration::MAX),
        ),
        ("Duration::MAX ttl", Take::new("bad", Duration::MAX, "h")),
        ("NUL in name", Take::new("b\0ad", LONG, "h")),
        (
            "empty holder ok, NUL in holder",
            Take::new("bad", LONG, "\0"),
        ),
    ];
    for (what, take) in bad {
        for waiting in [false, true] {
            let take = if waiting {
                take.clone().wait(wait)
            } else {
                take.clone()
            };
            let err = take.on(&mut conn).map(|l| l.is_some()).unwrap_err();
            assert!(
                err.is_invalid_input(),
                "{what} (waiting {waiting}): {err:?}"
            );
        }
    }
    for (what, w) in [
        ("zero poll", wait.poll_interval(Duration::ZERO)),
        (
            "poll of 40 days (a place of 400 days)",
            wait.poll_interval(Duration::from_secs(40 * 86400)),
        ),
    ] {
        let err = Take::new("bad", LONG, "h")
            .wait(w)
            .on(&mut conn)
            .map(|l| l.is_some())
            .unwrap_err();
        assert!(err.is_invalid_input(), "{what}: {err:?}");
    }
    let pool = db.pool(2);
    for (what, campaign) in [
        (
            "value with NUL",
            Leadership::campaign(&pool, "bad", LONG, "h", Some("a\0")),
        ),
        (
            "value too long",
            Leadership::campaign(&pool, "bad", LONG, "h", Some(&"v".repeat(65_536))),
        ),
        (
            "zero ttl",
            Leadership::campaign(&pool, "bad", Duration::ZERO, "h", None),
        ),
        (
            "empty name",
            Leadership::campaign(&pool, "", LONG, "h", None),
        ),
    ] {
        let err = campaign.map(|_| ()).unwrap_err();
        assert!(err.is_invalid_input(), "{what}: {err:?}");
    }
    for table in [
        "tenure_lease_names",
        "tenure_lease_waiters",
        "tenure_leases",
    ] {
        let n = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM {table}"));
        assert_eq!(n, 0, "bad input wrote {n} rows to {table}");
    }
    // A value with NUL, or too long, for a valid lease changes nothing either.
    let held = lease::try_take(&mut conn, "ok", LONG, "h")
        .unwrap()
        .unwrap();
    held.set_value(&mut conn, Some("kept")).unwrap();
    for (what, value) in [
        ("NUL", "a\0b".to_owned()),
        ("65536 bytes", "v".repeat(65_536)),
    ] {
        let err = held.set_value(&mut conn, Some(&value)).unwrap_err();
        assert!(err.is_invalid_input(), "{what}: {err:?}");
    }
    // The longest value is accepted and read back whole, 4-byte characters too.
    let longest = "🦀".repeat(lease::MAX_VALUE_BYTES / 4);
    held.set_value(&mut conn, Some(&longest)).unwrap();
    let info = lease::inspect(&mut conn, "ok").unwrap().unwrap();
    assert_eq!(info.value.as_deref(), Some(longest.as_str()));
}

/// Asks the waiting takes of the mixed scenario to give up.
static STOP: AtomicBool = AtomicBool::new(false);

fn stop_asked() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Promise 1 and 2: a mix of try_take, waiting takes, renewals, releases, force releases,
/// expiry (short ttls) and verify transactions on a lease of 2: judged by verified instants on
/// the database's clock, never more than 2 holders; fences distinct and growing in grant
/// order per thread.
fn mixed_operations_never_exceed_n_holders_and_fences_grow(backend: Backend) {
    const N: u32 = 2;
    const THREADS: usize = 8;
    const ROUNDS: usize = 25;
    let db = TestDb::migrated(backend);
    let holds = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..THREADS)
        .map(|i| {
            let mut conn = db.connect();
            let holds = holds.clone();
            std::thread::spawn(move || {
                let mut last_fence = 0;
                for round in 0..ROUNDS {
                    let op = (i + round) % 4;
                    let ttl = if op == 3 {
                        Duration::from_millis(150)
                    } else {
                        LONG
                    };
                    let take = Take::new("mix", ttl, &format!("t{i}")).holders(N);
                    let take = if op % 2 == 0 {
                        take.wait(
                            Wait::up_to(Duration::from_secs(20))
                                .poll_interval(Duration::from_millis(20))
                                .cancel_when(stop_asked),
                        )
                    } else {
                        take
                    };
                    let got = match take.on(&mut conn) {
                        Ok(Some(l)) => l,
                        Ok(None) => {
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                        Err(e) if e.is_retryable() => continue,
                        Err(e) => panic!("t{i}: {e:?}"),
                    };
                    let mut held = got;
                    assert!(held.fence() > last_fence, "fences go back in one thread");
                    last_fence = held.fence();
                    let mut verified = Vec::new();
                    for step in 0..3 {
                        let at = tenure::transaction(&mut conn, |c| {
                            held.verify(c)?;
                            tenure::database_now(c)
                        });
                        match at {
                            Ok(at) => verified.push(at),
                            Err(e) if e.is_lease_lost() => break,
                            Err(e) if e.is_retryable() => {}
                            Err(e) => panic!("t{i}: {e:?}"),
                        }
                        std::thread::sleep(Duration::from_millis(3));
                        if step == 1 && op == 0 {
                            let _ = held.renew(&mut conn, LONG);
                        }
                    }
                    if let (Some(from), Some(to)) = (verified.first(), verified.last()) {
                        holds.lock().unwrap().push((held.fence(), *from, *to));
                    }
                    match op {
                        1 if i % 3 == 0 => {
                            let _ = lease::force_release(&mut conn, "mix");
                        }
                        3 => {} // left to lapse
                        _ => {
                            let _ = held.release(&mut conn);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread panicked");
    }
    STOP.store(true, Ordering::SeqCst);
    let holds = holds.lock().unwrap();
    assert!(holds.len() > THREADS * ROUNDS / 4, "{} holds", holds.len());
    let mut edges: Vec<(chrono::DateTime<chrono::Utc>, i32)> = Vec::new();
    for (_, from, to) in holds.iter() {
        edges.push((*from, 1));
        edges.push((*to, -1));
    }
    edges.sort();
    let (mut now, mut most) = (0, 0);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    // Touching [from, to] intervals: an end and a start at one instant sort end first; a
    // hold verified at one instant only is a point, counted at that instant.
    assert!(most <= N as i32, "{most} holders at once of a lease of {N}");
    let mut fences: Vec<i64> = holds.iter().map(|h| h.0).collect();
    fences.sort();
    let n = fences.len();
    fences.dedup();
    assert_eq!(fences.len(), n, "a fence repeated");
}

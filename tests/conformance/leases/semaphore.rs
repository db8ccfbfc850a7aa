//! Leases of N holders: never more than N at once (by the database's clock and in this
//! process), every waiter served, a fence per grant growing per name; a naive count-then-insert
//! semaphore, judged the same way, is caught over-granting.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use tenure::lease::{self, Take, Wait};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, concrete, conformance, contest, now_sql, placeholders};

conformance!(
    n_holders_never_exceed_n_and_every_waiter_is_served,
    negative_control_a_count_then_insert_semaphore_over_grants,
    a_name_keeps_one_number_of_holders_while_held,
);

const CONTENDERS: usize = 32;
const GRANTS_EACH: usize = 4;
const LONG: Duration = Duration::from_secs(120);

/// The most intervals `[start, end)` that overlap at one instant.
fn most_at_once(intervals: &[(DateTime<Utc>, DateTime<Utc>)]) -> usize {
    let mut edges: Vec<(DateTime<Utc>, i32)> = Vec::new();
    for (start, end) in intervals {
        edges.push((*start, 1));
        edges.push((*end, -1));
    }
    // At equal instants an end comes before a start: touching intervals do not overlap.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    most as usize
}

/// The database's clock inside a transaction that verified the lease: an instant at which
/// the lease was surely held.
fn held_at(conn: &mut AnyConnection, held: &lease::Lease) -> DateTime<Utc> {
    tenure::transaction(conn, |c| {
        held.verify(c)?;
        tenure::database_now(c)
    })
    .expect("the lease is held (its ttl is long)")
}

/// 32 contenders on their own connections take a lease of N (1, 3, 8) 4 times each, waiting
/// in line, hold it a few milliseconds and release it. Each hold's interval, from a verified
/// instant after the grant to one before the release, by the database's clock: never more
/// than N overlap; nor do more than N holders count themselves in at once in this process.
/// Every take is granted (no waiter is lost), with a distinct fence.
fn n_holders_never_exceed_n_and_every_waiter_is_served(backend: Backend) {
    let db = TestDb::migrated(backend);
    for holders in [1u32, 3, 8] {
        let name = format!("sem-{holders}");
        let inside = Arc::new(AtomicUsize::new(0));
        let most_inside = Arc::new(AtomicUsize::new(0));
        let holds = Arc::new(Mutex::new(Vec::new()));
        let start = Arc::new(Barrier::new(CONTENDERS));
        let threads: Vec<_> = (0..CONTENDERS)
            .map(|i| {
                let mut conn = db.connect();
                let (name, inside, most_inside, holds, start) = (
                    name.clone(),
                    inside.clone(),
                    most_inside.clone(),
                    holds.clone(),
                    start.clone(),
                );
                std::thread::spawn(move || {
                    let take = Take::new(&name, LONG, &format!("contender {i}"))
                        .holders(holders)
                        .wait(Wait::up_to(LONG));
                    start.wait();
                    for round in 0..GRANTS_EACH {
                        let mut held = take
                            .on(&mut conn)
                            .expect("no error")
                            .unwrap_or_else(|| panic!("contender {i} round {round}: not served"));
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most_inside.fetch_max(now, Ordering::SeqCst);
                        let from = held_at(&mut conn, &held);
                        std::thread::sleep(Duration::from_millis(1 + (i as u64 % 3)));
                        let to = held_at(&mut conn, &held);
                        inside.fetch_sub(1, Ordering::SeqCst);
                        assert!(held.release(&mut conn).expect("release"));
                        holds
                            .lock()
                            .unwrap()
                            .push((held.fence(), held.slot(), from, to));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("a contender panicked");
        }
        let holds = holds.lock().unwrap();
        assert_eq!(holds.len(), CONTENDERS * GRANTS_EACH, "N = {holders}");
        let most = most_inside.load(Ordering::SeqCst);
        assert!(
            most <= holders as usize,
            "N = {holders}: {most} held at once in this process"
        );
        let intervals: Vec<_> = holds.iter().map(|h| (h.2, h.3)).collect();
        let overlapping = most_at_once(&intervals);
        assert!(
            overlapping <= holders as usize,
            "N = {holders}: {overlapping} holds overlap by the database's clock"
        );
        let mut fences: Vec<i64> = holds.iter().map(|h| h.0).collect();
        fences.sort();
        fences.dedup();
        assert_eq!(fences.len(), holds.len(), "N = {holders}: a fence repeated");
        assert!(
            holds.iter().all(|h| (0..holders as i32).contains(&h.1)),
            "N = {holders}: a slot out of range"
        );
    }
}

/// The same judge on a semaphore without the name's lock: count the live holders, then insert
/// a holder if fewer than N (a barrier between the two, so every contender counts before any
/// inserts). It grants more than N: the judge above can see over-granting.
fn negative_control_a_count_then_insert_semaphore_over_grants(backend: Backend) {
    const N: i64 = 3;
    let db = TestDb::migrated(backend);
    let barrier = Arc::new(Barrier::new(8));
    let count_sql = format!(
        "SELECT COUNT(*) AS n FROM tenure_leases WHERE name = {} AND token IS NOT NULL AND expires_at > {}",
        placeholders(backend, 1),
        now_sql(backend)
    );
    let insert_sql = format!(
        "INSERT INTO tenure_leases (name, slot, token, holder, fence, acquired_at, expires_at, reusable_at) \
         VALUES ({}, 'naive', 0, {now}, {later}, {later})",
        placeholders(backend, 3),
        now = now_sql(backend),
        later = match backend {
            Backend::Postgres => "statement_timestamp() + interval '1 hour'",
            Backend::Mysql => "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
            Backend::Sqlite => "strftime('%Y-%m-%d %H:%M:%f','now','+1 hour')",
        },
    );
    let mut worst = 0;
    let b = barrier.clone();
    contest(
        &db,
        8,
        10,
        move |round, i, conn| -> bool {
            #[derive(QueryableByName)]
            struct N {
                #[diesel(sql_type = BigInt)]
                n: i64,
            }
            let name = format!("naive-{round}");
            let live = concrete!(conn, c => diesel::sql_query(&count_sql)
                .bind::<Text, _>(&name)
                .get_result::<N>(c))
            .expect("count")
            .n;
            b.wait();
            if live >= N {
                return false;
            }
            concrete!(conn, c => diesel::sql_query(&insert_sql)
                .bind::<Text, _>(&name)
                .bind::<Integer, _>(i as i32)
                .bind::<tenure::sql_types::Token, _>(uuid::Uuid::new_v4())
                .execute(c))
            .expect("insert");
            true
        },
        |_, granted| worst = worst.max(granted.iter().filter(|g| **g).count()),
    );
    assert!(
        worst > N as usize,
        "the naive semaphore never granted more than {N} at once"
    );
}

/// A lease taken for 3 holders refuses a take for 2 while held (typed error, nothing
/// changed); once every holder released, the name takes the new number.
fn a_name_keeps_one_number_of_holders_while_held(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let three = Take::new("pool", LONG, "a").holders(3);
    let mut first = three.on(&mut conn).unwrap().expect("free");
    let err = Take::new("pool", LONG, "b")
        .holders(2)
        .on(&mut conn)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::LeaseHoldersMismatch {
                holders: 3,
                asked: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(lease::holders(&mut conn, "pool").unwrap().len(), 1);
    for bad in [0, lease::MAX_HOLDERS + 1] {
        let err = Take::new("pool", LONG, "c")
            .holders(bad)
            .on(&mut conn)
            .unwrap_err();
        assert!(err.is_invalid_input(), "{err:?}");
    }
    assert!(first.release(&mut conn).unwrap());
    let two = Take::new("pool", LONG, "b").holders(2);
    let a = two.on(&mut conn).unwrap().expect("free");
    let b = two.on(&mut conn).unwrap().expect("a second holder");
    assert!(two.on(&mut conn).unwrap().is_none(), "a third holder of 2");
    assert!(b.fence() > a.fence() && a.fence() > first.fence());
}

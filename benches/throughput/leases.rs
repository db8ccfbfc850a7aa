//! S: leases. S1 and S2: how soon a waiter in line gets a lease after its holder releases it
//! (released by this process, which wakes its waiters at once; released by another session,
//! which on PostgreSQL wakes them by NOTIFY and elsewhere leaves them to their next poll, every
//! 100 ms by default). S3: take and release, one caller, no contention (the cost of a grant).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::Text;
use tenure::lease::{self, Take, Wait};
use tenure::{AnyConnection, Backend};

use crate::options::Options;
use crate::support::{BenchDb, Figures, percentile, with_latencies};

const TTL: Duration = Duration::from_secs(60);

fn in_line(conn: &mut AnyConnection) -> bool {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query("SELECT COUNT(*) AS n FROM tenure_lease_waiters")
        .get_result::<N>(conn)
        .expect("count the line")
        .n
        > 0
}

/// Releases the lease as another process would: its row cleared, and on PostgreSQL a NOTIFY.
fn release_from_outside(conn: &mut AnyConnection, backend: Backend) {
    let (update, notify) = match backend {
        Backend::Postgres => (
            "UPDATE tenure_leases SET token = NULL, reusable_at = statement_timestamp() WHERE name = $1",
            Some("SELECT pg_notify('tenure_leases', $1)"),
        ),
        Backend::Mysql => (
            "UPDATE tenure_leases SET token = NULL, reusable_at = UTC_TIMESTAMP(6) WHERE name = ?",
            None,
        ),
        Backend::Sqlite => (
            "UPDATE tenure_leases SET token = NULL, reusable_at = strftime('%Y-%m-%d %H:%M:%f','now') WHERE name = ?",
            None,
        ),
    };
    diesel::sql_query(update)
        .bind::<Text, _>("handoff")
        .execute(conn)
        .expect("release");
    if let Some(notify) = notify {
        diesel::sql_query(notify)
            .bind::<Text, _>("handoff")
            .execute(conn)
            .expect("notify");
    }
}

/// S1/S2: release -> grant to the waiter at the head of the line, `options.samples` times;
/// prints p99 beside the table's p50/p95.
pub fn handoff(backend: Backend, options: &Options, from_outside: bool) -> Figures {
    let db = BenchDb::new(backend);
    let label = if from_outside { "S2" } else { "S1" };
    handoff_on(&db, backend, options, from_outside, label)
}

fn handoff_on(
    db: &BenchDb,
    backend: Backend,
    options: &Options,
    from_outside: bool,
    label: &str,
) -> Figures {
    let mut conn = db.connect();
    let mut waiter_conn = db.connect();
    let (go, start) = mpsc::channel::<()>();
    let (granted, grants) = mpsc::channel::<Instant>();
    let waiter = std::thread::spawn(move || {
        let take = Take::new("handoff", TTL, "waiter").wait(Wait::up_to(TTL));
        while start.recv().is_ok() {
            let mut lease = take.on(&mut waiter_conn).expect("take").expect("granted");
            let _ = granted.send(Instant::now());
            lease.release(&mut waiter_conn).expect("release");
        }
    });
    let mut latencies = Vec::new();
    let began = Instant::now();
    for _ in 0..options.samples {
        let mut held = loop {
            if let Some(lease) = lease::try_take(&mut conn, "handoff", TTL, "holder").expect("take")
            {
                break lease;
            }
        };
        go.send(()).expect("the waiter runs");
        while !in_line(&mut conn) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The waiter is in its pause (or its wait for a wake-up).
        std::thread::sleep(Duration::from_millis(20));
        let released = Instant::now();
        if from_outside {
            release_from_outside(&mut conn, backend);
        } else {
            held.release(&mut conn).expect("release");
        }
        let at = grants.recv().expect("a grant");
        latencies.push(at.saturating_duration_since(released));
    }
    let rate = options.samples as f64 / began.elapsed().as_secs_f64();
    drop(go);
    waiter.join().expect("the waiter");
    latencies.sort();
    let p99 = percentile(&latencies, 0.99).unwrap_or_default();
    println!(
        "| {backend:?} | {label}: p99 {:.2} ms over {} hand-offs | | | | |",
        p99.as_secs_f64() * 1000.0,
        latencies.len()
    );
    with_latencies(rate, latencies)
}

/// S4: S1 with 4 threads polling `try_take` as fast as they can beside the waiter: release ->
/// the waiter's grant. The pollers get the lease only between hand-offs, while nobody stands
/// in line (their grants are counted: they show the pollers were at it); that none overtakes a
/// waiter is `leases::line::*::pollers_cannot_overtake_a_waiter`.
pub fn handoff_among_pollers(backend: Backend, options: &Options) -> Figures {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    let db = BenchDb::new(backend);
    let stop = Arc::new(AtomicBool::new(false));
    let overtook = Arc::new(AtomicUsize::new(0));
    let pollers: Vec<_> = (0..4)
        .map(|i| {
            let mut conn = db.connect();
            let (stop, overtook) = (stop.clone(), overtook.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(Some(mut lease)) =
                        lease::try_take(&mut conn, "handoff", TTL, &format!("poller {i}"))
                    {
                        overtook.fetch_add(1, Ordering::SeqCst);
                        let _ = lease.release(&mut conn);
                    }
                }
            })
        })
        .collect();
    let figures = handoff_on(&db, backend, options, false, "S4");
    stop.store(true, Ordering::SeqCst);
    for poller in pollers {
        poller.join().expect("a poller");
    }
    println!(
        "| {backend:?} | S4: grants to the pollers, between hand-offs: {} | | | | |",
        overtook.load(Ordering::SeqCst)
    );
    figures
}

/// S3: try_take then release on one connection, no contention: grants a second, and the
/// latency of each take.
pub fn take_release(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let rounds = options.samples * 10;
    let mut latencies = Vec::with_capacity(rounds);
    let began = Instant::now();
    for i in 0..rounds {
        let sent = Instant::now();
        let mut lease = lease::try_take(&mut conn, &format!("cycle-{}", i % 16), TTL, "bench")
            .expect("take")
            .expect("free");
        latencies.push(sent.elapsed());
        lease.release(&mut conn).expect("release");
    }
    with_latencies(rounds as f64 / began.elapsed().as_secs_f64(), latencies)
}

/// S5: a guard from a pool, taken and released, one caller, no contention: with fast takeover
/// (the default: a liveness lock first, on the servers on a connection of its own) or without.
pub fn guard_take_release(backend: Backend, options: &Options, fast_takeover: bool) -> Figures {
    let db = BenchDb::new(backend);
    let pool = db.pool(4);
    let rounds = options.samples;
    let mut latencies = Vec::with_capacity(rounds);
    let began = Instant::now();
    for i in 0..rounds {
        let take =
            Take::new(&format!("guard-{}", i % 16), TTL, "bench").fast_takeover(fast_takeover);
        let sent = Instant::now();
        let guard = tenure::LeaseGuard::take_pooled_as(&pool, &take)
            .expect("take")
            .expect("free");
        latencies.push(sent.elapsed());
        assert!(guard.release().expect("release"));
    }
    with_latencies(rounds as f64 / began.elapsed().as_secs_f64(), latencies)
}

//! Claims of a limited queue racing holders of its head jobs and a canceller, on the
//! servers: the queue's limit, a key's smallest cap and a rate hold across the rounds of
//! concurrent claims (PostgreSQL's mark passes held jobs over and the claim picks again), each
//! claim returns its jobs once and in claim order, and PostgreSQL counts no deadlock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, Utc};
use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobClaim, NewJob};
use tenure::{AnyConnection, Backend};

use super::limits::{Id, key_state};
use super::{TTL, deadlocks, end_round, nothing_live};
use crate::common::{TestDb, count, on_servers};

on_servers!(held_jobs_cancels_and_claimers_race_within_every_limit);

/// Many rounds: 60 jobs in a queue limited to four (a third capped on key `k` at two, some
/// at one, a third rated on `r` at three per 300 ms); four claimers (claim and claim_kinds,
/// batches of 1, 2, 5 and 9) race two holders (each locks up to four jobs at the head for a
/// moment, the mark must pass them over) and a canceller. A sampler reads the queue's running
/// jobs and the key's (with its smallest cap) in one statement each. Then: no claim failed,
/// none returned more than its max or a job twice, the queue's limit and the key's smallest
/// cap never passed, no window of 300 ms holds more than three rated starts, the starts are
/// exactly the rated jobs claimed, everything finished, and PostgreSQL counted no deadlock.
fn held_jobs_cancels_and_claimers_race_within_every_limit(backend: Backend) {
    const ROUNDS: usize = 6;
    const JOBS: usize = 60;
    const QUEUE_LIMIT: i64 = 4;
    const RATE: usize = 3;
    let per = Duration::from_millis(300);
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    jobs::limit_queue(&mut setup, "lr", Some(QUEUE_LIMIT as u32)).unwrap();
    let claimed: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let queue_max = Arc::new(AtomicI64::new(0));
    let key_over = Arc::new(AtomicUsize::new(0));
    let out_of_order = Arc::new(AtomicUsize::new(0));
    let claims_made = Arc::new(AtomicUsize::new(0));
    let rated_starts: Arc<Mutex<Vec<DateTime<Utc>>>> = Arc::default();
    let holds = Arc::new(AtomicUsize::new(0));
    let mut cancelled = 0usize;
    let mut sessions: Vec<AnyConnection> = Vec::new();
    let started = Clock::now();
    for round in 0..ROUNDS {
        let batch: Vec<NewJob> = (0..JOBS)
            .map(|i| {
                let job = NewJob::new("lr", if i % 2 == 0 { "x" } else { "y" }, vec![i as u8])
                    .priority((i % 4) as i32);
                match i % 3 {
                    0 => job.limit("k", if i % 9 == 0 { 1 } else { 2 }),
                    1 => job.rate_limit("r", RATE as u32, per),
                    _ => job,
                }
            })
            .collect();
        let round_ids: Vec<i64> = jobs::enqueue_many(&mut setup, &batch)
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        let running = Arc::new(AtomicBool::new(true));
        let give_up = Clock::now() + Duration::from_secs(90);
        let claimers: Vec<_> = [(1usize, false), (2, true), (5, false), (9, true)]
            .into_iter()
            .map(|(size, kinds)| {
                let mut conn = db.connect();
                let (claimed, out_of_order, claims_made, running, rated_starts) = (
                    claimed.clone(),
                    out_of_order.clone(),
                    claims_made.clone(),
                    running.clone(),
                    rated_starts.clone(),
                );
                std::thread::spawn(move || {
                    loop {
                        assert!(
                            Clock::now() < give_up,
                            "round {round}: jobs still wait or run after 90 s"
                        );
                        let got = if kinds {
                            jobs::claim_kinds(&mut conn, "lr", &["x", "y"], size, TTL)
                        } else {
                            jobs::claim(&mut conn, "lr", size, TTL)
                        }
                        .unwrap_or_else(|e| panic!("claim of {size} (kinds {kinds}): {e:?}"));
                        claims_made.fetch_add(1, Ordering::SeqCst);
                        assert!(got.len() <= size, "claim of {size} took {}", got.len());
                        if got.is_empty() {
                            if !running.load(Ordering::SeqCst) && nothing_live(&mut conn, "lr") {
                                return conn;
                            }
                            std::thread::sleep(Duration::from_millis(2));
                            continue;
                        }
                        let keys: Vec<(i32, i64)> =
                            got.iter().map(|j| (j.priority, j.id)).collect();
                        let mut sorted = keys.clone();
                        sorted.sort_unstable();
                        if sorted != keys {
                            out_of_order.fetch_add(1, Ordering::SeqCst);
                        }
                        {
                            let mut map = claimed.lock().unwrap();
                            for j in &got {
                                *map.entry(j.id).or_default() += 1;
                                assert_eq!(j.attempt, 1, "job {} claimed again", j.id);
                            }
                        }
                        rated_starts.lock().unwrap().extend(
                            got.iter()
                                .filter(|j| j.payload[0] % 3 == 1)
                                .map(|j| j.claimed_at),
                        );
                        std::thread::sleep(Duration::from_millis(3));
                        let claims: Vec<JobClaim> = got.iter().map(|j| j.claim()).collect();
                        jobs::complete(&mut conn, &claims).expect("complete");
                    }
                })
            })
            .collect();
        let holders: Vec<_> = (0..2)
            .map(|h| {
                let mut conn = db.connect_raw();
                let (running, holds) = (running.clone(), holds.clone());
                std::thread::spawn(move || {
                    let mut n = 0usize;
                    while running.load(Ordering::SeqCst) && n < 400 {
                        n += 1;
                        conn.batch_execute("BEGIN").unwrap();
                        let locked = diesel::sql_query(format!(
                            "SELECT id FROM tenure_jobs WHERE queue = 'lr' AND state = 'waiting' \
                             ORDER BY priority, due_at, id LIMIT {} FOR UPDATE SKIP LOCKED",
                            1 + (n + h) % 4
                        ))
                        .load::<Id>(&mut conn)
                        .unwrap();
                        holds.fetch_add(locked.len(), Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(4));
                        conn.batch_execute("ROLLBACK").unwrap();
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    conn
                })
            })
            .collect();
        let to_cancel: Vec<i64> = round_ids.iter().copied().skip(2).step_by(7).collect();
        let mut canceller_conn = db.connect();
        let canceller = std::thread::spawn(move || {
            let mut n = 0;
            for id in to_cancel {
                if jobs::cancel(&mut canceller_conn, id).expect("cancel") {
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(3));
            }
            (canceller_conn, n)
        });
        let mut sampler_conn = db.connect();
        let (sampling, qmax, over) = (running.clone(), queue_max.clone(), key_over.clone());
        let sampler = std::thread::spawn(move || {
            while sampling.load(Ordering::SeqCst) {
                let q = count(
                    &mut sampler_conn,
                    "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'lr' AND state = 'running'",
                );
                qmax.fetch_max(q, Ordering::SeqCst);
                let (n, least) = key_state(&mut sampler_conn, "k");
                if least.is_some_and(|least| n > i64::from(least)) {
                    over.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            sampler_conn
        });
        let (conn, n) = canceller.join().expect("the canceller panicked");
        cancelled += n;
        sessions.push(conn);
        // The holders run until the waiting jobs are gone (or 400 holds each).
        let drained = Clock::now() + Duration::from_secs(60);
        while Clock::now() < drained
            && count(
                &mut setup,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'lr' AND state = 'waiting'",
            ) > 0
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        running.store(false, Ordering::SeqCst);
        for t in holders {
            sessions.push(t.join().expect("a holder panicked"));
        }
        sessions.push(sampler.join().expect("the sampler panicked"));
        for t in claimers {
            sessions.push(t.join().expect("a claimer panicked"));
        }
        end_round(
            backend,
            &mut setup,
            std::mem::take(&mut sessions),
            "lr",
            round,
        );
    }
    let claimed = claimed.lock().unwrap();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "jobs claimed more than once: {twice:?}");
    let recorded = count(
        &mut setup,
        "SELECT COUNT(*) AS n FROM tenure_limit_starts WHERE limit_key = 'r'",
    );
    let mut starts = rated_starts.lock().unwrap().clone();
    starts.sort_unstable();
    let crowded = starts
        .windows(RATE + 1)
        .filter(|w| (w[RATE] - w[0]).to_std().unwrap_or_default() < per)
        .count();
    let rated_claimed = count(
        &mut setup,
        "SELECT COUNT(*) AS n FROM tenure_jobs j JOIN tenure_job_limits l ON l.job_id = j.id \
         WHERE l.limit_key = 'r' AND j.claimed_at IS NOT NULL",
    );
    let deadlocked = if backend == Backend::Postgres {
        deadlocks(&db, &mut sessions)
    } else {
        0
    };
    let queue_max = queue_max.load(Ordering::SeqCst);
    let key_over = key_over.load(Ordering::SeqCst);
    println!(
        "{backend}: {ROUNDS} rounds x {JOBS} jobs, {} claims, {} claimed once each, {cancelled} \
         cancelled waiting, {} holds, queue running at most {queue_max}, {key_over} samples past \
         the key's smallest cap, {} rated starts ({rated_claimed} rated claimed), {crowded} \
         windows past the rate, {} claims out of claim order, {deadlocked} deadlocks, {:?}",
        claims_made.load(Ordering::SeqCst),
        claimed.len(),
        holds.load(Ordering::SeqCst),
        starts.len(),
        out_of_order.load(Ordering::SeqCst),
        started.elapsed()
    );
    assert!(
        queue_max <= QUEUE_LIMIT,
        "{queue_max} of the queue ran at once"
    );
    assert_eq!(key_over, 0, "the key's smallest cap passed");
    assert_eq!(
        starts.len() as i64,
        rated_claimed,
        "rated claims seen = rated claimed"
    );
    assert_eq!(recorded, rated_claimed, "starts recorded = rated claims");
    assert_eq!(crowded, 0, "more than {RATE} starts in a window of {per:?}");
    assert_eq!(deadlocked, 0, "PostgreSQL detected deadlocks");
    assert_eq!(
        out_of_order.load(Ordering::SeqCst),
        0,
        "claims returned their jobs out of claim order"
    );
}

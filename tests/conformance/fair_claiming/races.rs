//! Fair claiming racing the servers' own machinery: rotations racing fair enqueues; fair and
//! sequence enqueues racing in one batch. Jobs' kinds name their tenants.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use tenure::jobs::{self, ClaimedJob, NewJob};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count, enqueue_id, on_servers};

on_servers!(
    rotations_racing_fair_enqueues_keep_every_entry_and_turn,
    fair_and_sequence_batches_in_any_order_never_deadlock,
);

const TTL: Duration = Duration::from_secs(600);

fn fair(queue: &str, tenant: &str) -> NewJob {
    NewJob::new(queue, tenant, vec![]).fair_key(tenant)
}

fn complete_all(conn: &mut AnyConnection, claimed: &[ClaimedJob]) {
    let claims: Vec<_> = claimed.iter().map(|job| job.claim()).collect();
    if !claims.is_empty() {
        jobs::complete(conn, &claims).unwrap();
    }
}

fn claim_and_complete(conn: &mut AnyConnection, queue: &str, n: usize) -> Vec<ClaimedJob> {
    let claimed = jobs::claim(conn, queue, n, TTL).unwrap();
    complete_all(conn, &claimed);
    claimed
}

/// Producers enqueue fair jobs of three tenants (batches and single jobs) while a rotator
/// rotates the ready ring as fast as it may and a claimer claims and completes: afterwards
/// every waiting job has exactly one entry, with its stamp and tenant, and no job was lost.
fn rotations_racing_fair_enqueues_keep_every_entry_and_turn(backend: Backend) {
    const PRODUCERS: usize = 3;
    const ROUNDS: usize = 60;
    let db = TestDb::migrated(backend);
    let stop = Arc::new(AtomicBool::new(false));
    let rotator = {
        let mut conn = db.connect();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rotations = 0;
            while !stop.load(Ordering::SeqCst) {
                if jobs::rotate_ready(&mut conn, Duration::ZERO)
                    .unwrap()
                    .is_some()
                {
                    rotations += 1;
                }
            }
            rotations
        })
    };
    let claimed: Arc<Mutex<BTreeSet<i64>>> = Arc::default();
    let claimer = {
        let mut conn = db.connect();
        let (stop, claimed) = (stop.clone(), claimed.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let got = claim_and_complete(&mut conn, "rot", 3);
                let mut claimed = claimed.lock().unwrap();
                for job in got {
                    assert!(claimed.insert(job.id), "job {} claimed twice", job.id);
                }
            }
        })
    };
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let mut conn = db.connect();
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let tenant = format!("t{}", (p + round) % 3);
                    if round % 2 == 0 {
                        enqueue_id(&mut conn, fair("rot", &tenant));
                    } else {
                        let batch = vec![fair("rot", &tenant), fair("rot", "t0").priority(1)];
                        jobs::enqueue_many(&mut conn, &batch).unwrap();
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    claimer.join().unwrap();
    let rotations = rotator.join().unwrap();
    let mut conn = db.connect();
    let total = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs");
    assert_eq!(total as usize, PRODUCERS * ROUNDS * 3 / 2);
    let waiting = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'",
    );
    let entries = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_ready");
    let matched = count(
        &mut conn,
        "SELECT COUNT(DISTINCT r.id) AS n FROM tenure_ready r JOIN tenure_jobs j ON j.id = r.id \
         WHERE j.state = 'waiting' AND r.fair_stamp = j.fair_stamp AND r.fair_key = j.fair_key",
    );
    assert_eq!(
        (entries, matched),
        (waiting, waiting),
        "ring entries against waiting jobs after {rotations} rotations"
    );
    // Everything left is claimed, each job once.
    loop {
        let got = claim_and_complete(&mut conn, "rot", 50);
        if got.is_empty() {
            break;
        }
        let mut claimed = claimed.lock().unwrap();
        for job in got {
            assert!(claimed.insert(job.id), "job {} claimed twice", job.id);
        }
    }
    assert_eq!(claimed.lock().unwrap().len() as i64, total);
}

/// Producers enqueue batches that mix fair jobs of shared tenants with jobs of shared
/// sequences (some fair too), in opposite orders, on their own and in callers'
/// transactions, while a claimer completes (releasing sequences): no enqueue fails.
fn fair_and_sequence_batches_in_any_order_never_deadlock(backend: Backend) {
    const PRODUCERS: usize = 4;
    const ROUNDS: usize = 12;
    let db = TestDb::migrated(backend);
    let barrier = Arc::new(Barrier::new(PRODUCERS));
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let claimer = {
        let mut conn = db.connect();
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                claim_and_complete(&mut conn, "fs", 4);
            }
        })
    };
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let mut conn = db.connect();
            let (barrier, errors) = (barrier.clone(), errors.clone());
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let mut batch = vec![
                        fair("fs", "ta"),
                        NewJob::new("fs", "s", vec![]).sequence("s1"),
                        fair("fs", "tb").sequence("s2"),
                        fair("fs", &format!("n{round}")),
                        NewJob::new("fs", "s", vec![]).sequence("s2"),
                        fair("fs", "tb"),
                        fair("fs", "ta").sequence("s1"),
                    ];
                    if p % 2 == 1 {
                        batch.reverse();
                    }
                    barrier.wait();
                    // In a caller's transaction tenure cannot run it again: a deadlock there
                    // is the caller's to retry (`is_retryable`), as it says.
                    let outcome = if p < 2 {
                        jobs::enqueue_many(&mut conn, &batch)
                    } else {
                        let mut tries = 0;
                        loop {
                            tries += 1;
                            match tenure::transaction(&mut conn, |c| jobs::enqueue_many(c, &batch))
                            {
                                Err(e) if e.is_retryable() && tries < 5 => continue,
                                outcome => break outcome,
                            }
                        }
                    };
                    if let Err(e) = outcome {
                        let how = if p < 2 { "own" } else { "caller's" };
                        errors
                            .lock()
                            .unwrap()
                            .push(format!("{how} transaction: {e}"));
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    claimer.join().unwrap();
    let errors = errors.lock().unwrap().clone();
    assert!(
        errors.is_empty(),
        "{} enqueues failed: {errors:?}",
        errors.len()
    );
    let mut conn = db.connect();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        (PRODUCERS * ROUNDS * 7) as i64
    );
}

//! Callers at REPEATABLE READ (MariaDB's default) with read views older than rotations
//! cancel, replace and enqueue while rotations and claims race them.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob};
use tenure::{Backend, Error};

use super::super::{NO_WAIT, TTL, assert_not_early, assert_ring_exact, claims};
use crate::common::TestDb;

/// Promise 6 with real threads: two callers run REPEATABLE READ transactions whose read view
/// starts (a read of the job) before a pause in which a fast rotator rotates, then cancel the
/// job, replace it (due in ten minutes, or now) or enqueue a fresh one, and commit; two
/// claimers claim meanwhile. Each caller's change commits or fails retryably (1412) with
/// nothing changed; no claim takes a job before its due time (a stale entry with the old
/// due time would), none twice; the ring ends exact.
#[test]
fn mysql_repeatable_read_callers_racing_rotations_keep_the_ring_exact() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tenure::jobs::OnDuplicate;

    const KEYS: usize = 40;
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for k in 0..KEYS {
        let job = NewJob::new("rr", "a", vec![]).dedup_key(format!("k{k}"));
        ids.push(jobs::enqueue(&mut conn, &job).unwrap().id);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (rotator, rotations) =
        super::super::spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(1));
    let claimed: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let (mut conn, stop, claimed) = (db.connect(), stop.clone(), claimed.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let batch = jobs::claim(&mut conn, "rr", 5, TTL).expect("claim must not fail");
                    for job in &batch {
                        assert_not_early(job);
                        *claimed.lock().unwrap().entry(job.id).or_default() += 1;
                    }
                    if !batch.is_empty() {
                        jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        })
        .collect();
    let callers: Vec<_> = (0..2u64)
        .map(|n| {
            let mut conn = db.connect();
            let ids = ids.clone();
            std::thread::spawn(move || {
                conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .unwrap();
                let (mut committed, mut retryable) = (0, 0);
                for i in 0..150u64 {
                    let k = usize::try_from((i * 7 + n * 13) % KEYS as u64).unwrap();
                    let outcome = conn.transaction::<_, Error, _>(|c| {
                        // The read view starts here.
                        jobs::get(c, ids[k])?;
                        std::thread::sleep(Duration::from_millis(3 + i % 5));
                        let keyed = NewJob::new("rr", "a", vec![]).dedup_key(format!("k{k}"));
                        match i % 4 {
                            0 => {
                                jobs::cancel(c, ids[k])?;
                                Ok(())
                            }
                            1 => {
                                let later = keyed
                                    .delay(Duration::from_secs(600))
                                    .on_duplicate(OnDuplicate::Replace);
                                jobs::enqueue(c, &later)?;
                                Ok(())
                            }
                            2 => {
                                jobs::enqueue(c, &keyed.on_duplicate(OnDuplicate::KeepEarlierDue))?;
                                Ok(())
                            }
                            _ => {
                                jobs::enqueue(c, &NewJob::new("rr", "b", vec![]))?;
                                Ok(())
                            }
                        }
                    });
                    match outcome {
                        Ok(()) => committed += 1,
                        Err(e) if e.is_retryable() => retryable += 1,
                        Err(e) => panic!("caller {n}, round {i}: not retryable: {e}"),
                    }
                }
                (committed, retryable)
            })
        })
        .collect();
    let (mut committed, mut retryable) = (0, 0);
    for caller in callers {
        let (c, r) = caller.join().unwrap();
        committed += c;
        retryable += r;
    }
    stop.store(true, Ordering::SeqCst);
    for claimer in claimers {
        claimer.join().unwrap();
    }
    rotator.join().unwrap();
    println!(
        "{committed} committed, {retryable} retryable failures, {} rotations",
        rotations.load(Ordering::SeqCst)
    );
    assert!(rotations.load(Ordering::SeqCst) >= 10, "too few rotations");
    let claimed = claimed.lock().unwrap();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "claimed twice: {twice:?}");
    assert_ring_exact(&mut conn, backend, "after the race");
    for _ in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    assert_ring_exact(&mut conn, backend, "after more rotations");
}

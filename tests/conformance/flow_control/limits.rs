//! Concurrency limits per key, enforced inside the claim.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use tenure::Backend;
use tenure::jobs::{self, NewJob, Outcome};
use tenure::worker::{JobContext, Worker};

use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    concurrent_claimers_never_exceed_a_key_limit,
    a_saturated_key_does_not_hold_up_the_others,
    bad_limits_are_refused,
);

const TTL: Duration = Duration::from_secs(60);

fn concurrent_claimers_never_exceed_a_key_limit(backend: Backend) {
    const PER_KEY: usize = 20;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut batch = Vec::new();
    for i in 0..PER_KEY {
        for key in ["k0", "k1", "k2"] {
            batch.push(
                NewJob::new("lim", key, vec![])
                    .limit(key, 2)
                    .priority(i as i32),
            );
        }
    }
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let running: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let most: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let mut conn = db.connect();
            let (running, most, done) = (running.clone(), most.clone(), done.clone());
            std::thread::spawn(move || {
                let until = Clock::now() + Duration::from_secs(40);
                while done.load(Ordering::SeqCst) < 3 * PER_KEY && Clock::now() < until {
                    let claimed = jobs::claim(&mut conn, "lim", 5, TTL).expect("claim");
                    if claimed.is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    for job in &claimed {
                        let mut r = running.lock().unwrap();
                        let n = r.entry(job.kind.clone()).or_default();
                        *n += 1;
                        let mut m = most.lock().unwrap();
                        let top = m.entry(job.kind.clone()).or_default();
                        *top = (*top).max(*n);
                    }
                    std::thread::sleep(Duration::from_millis(5 + (t as u64 % 3) * 5));
                    for job in &claimed {
                        *running.lock().unwrap().get_mut(&job.kind).unwrap() -= 1;
                        assert_eq!(
                            jobs::complete(&mut conn, &[job.claim()]).unwrap(),
                            vec![Outcome::Done]
                        );
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a claimer failed");
    }
    let most = most.lock().unwrap();
    for key in ["k0", "k1", "k2"] {
        assert!(
            most.get(key).copied().unwrap_or(0) <= 2,
            "{key} ran {:?} at once",
            most.get(key)
        );
        assert_eq!(most.get(key).copied(), Some(2), "the limit of 2 was used");
    }
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'"
        ),
        60
    );
    println!(
        "{backend} limits: 8 claimers, 3 keys x 20 jobs, limit 2: at most {most:?} at once per key"
    );
}

fn a_saturated_key_does_not_hold_up_the_others(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = pool.get().unwrap();
    // Key A's jobs come first in priority order and are slow; B's and C's are quick.
    let mut batch = Vec::new();
    for _ in 0..5 {
        batch.push(NewJob::new("keys", "A", vec![]).limit("A", 1).priority(-1));
    }
    for key in ["B", "C"] {
        for _ in 0..5 {
            batch.push(NewJob::new("keys", key, vec![]).limit(key, 1));
        }
    }
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let intervals: Intervals = Arc::default();
    let seen = intervals.clone();
    let worker = Worker::builder(pool.clone())
        .queue("keys")
        .threads(4)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("A", handler(seen.clone()))
        .raw_handler("B", handler(seen.clone()))
        .raw_handler("C", handler(seen))
        .start()
        .unwrap();
    poll_until(Duration::from_secs(20), Duration::from_millis(10), || {
        (worker.report().completed >= 15).then_some(())
    });
    worker.shutdown(Duration::from_secs(2));
    let intervals = intervals.lock().unwrap();
    assert_eq!(intervals.len(), 15);
    for key in ["A", "B", "C"] {
        let mut mine: Vec<_> = intervals.iter().filter(|(k, _, _)| k == key).collect();
        mine.sort_by_key(|(_, start, _)| *start);
        for pair in mine.windows(2) {
            assert!(pair[1].1 >= pair[0].2, "two {key} jobs overlapped");
        }
    }
    // While A was saturated (one at a time, 5 x 150 ms), B and C finished.
    let last_a = intervals
        .iter()
        .filter(|(k, _, _)| k == "A")
        .map(|(_, _, end)| *end)
        .max()
        .unwrap();
    let last_bc = intervals
        .iter()
        .filter(|(k, _, _)| k != "A")
        .map(|(_, _, end)| *end)
        .max()
        .unwrap();
    assert!(last_bc < last_a, "B and C waited for A");
}

type Intervals = Arc<Mutex<Vec<(String, Clock, Clock)>>>;

fn handler(
    seen: Intervals,
) -> impl Fn(&JobContext, &[u8]) -> Result<(), tenure::worker::JobError> + Send + Sync + 'static {
    move |ctx: &JobContext, _: &[u8]| {
        let start = Clock::now();
        std::thread::sleep(Duration::from_millis(if ctx.kind == "A" {
            150
        } else {
            30
        }));
        seen.lock()
            .unwrap()
            .push((ctx.kind.clone(), start, Clock::now()));
        Ok(())
    }
}

fn bad_limits_are_refused(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for job in [
        NewJob::new("q", "k", vec![]).limit("", 1),
        NewJob::new("q", "k", vec![]).limit("key", 0),
        NewJob::new("q", "k", vec![]).limit("key", 10_001),
    ] {
        assert!(
            jobs::enqueue(&mut conn, &job)
                .unwrap_err()
                .is_invalid_input()
        );
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
}

//! W3: a fan-in completed by concurrent claimers, each completing one job per transaction
//! (several worker processes, or handlers completing inside their own transactions): the
//! pattern in which a single counter row would serialize every completion.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, NewJob, Workflow};

use crate::support::{BenchDb, Figures, with_latencies};

/// Claimers in W3.
pub const CLAIMERS: usize = 8;

/// W3. `n` parts and one job waiting for all of them; `CLAIMERS` threads on their own
/// connections claim one part at a time and complete it in its own transaction; p50/p95
/// are per completion (the transaction that counts the part down).
pub fn fan_in_by_claimers(backend: Backend, n: usize) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let mut flow = Workflow::new("bench");
    let parts: Vec<_> = (0..n)
        .map(|_| flow.add(NewJob::new("bench", "part", vec![])))
        .collect();
    flow.add_after(&parts, NewJob::new("bench", "merge", vec![]));
    jobs::enqueue_workflow(&mut conn, &flow).expect("fill");
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let threads: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let done = done.clone();
            std::thread::spawn(move || {
                let mut latencies = Vec::new();
                while done.load(Ordering::Relaxed) < n + 1 {
                    let claimed =
                        jobs::claim(&mut conn, "bench", 1, Duration::from_secs(60)).expect("claim");
                    let Some(job) = claimed.first() else {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    };
                    let at = Instant::now();
                    jobs::complete(&mut conn, &[job.claim()]).expect("complete");
                    latencies.push(at.elapsed());
                    done.fetch_add(1, Ordering::Relaxed);
                }
                latencies
            })
        })
        .collect();
    let latencies: Vec<Duration> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("a claimer panicked"))
        .collect();
    let took = started.elapsed();
    with_latencies((n + 1) as f64 / took.as_secs_f64(), latencies)
}

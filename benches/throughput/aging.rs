//! Y: priority aging. A worker (4 threads) runs a steady stream of urgent jobs (priority -1,
//! 2,000 always waiting: each run enqueues the next), while low-priority jobs (priority 10)
//! arrive, one every 250 ms. Printed: the urgent stream's rate and the low jobs' waits, from
//! their due time to their claim (database clock), with aging after 1 s and 5 s, and without
//! aging (the control: the low jobs wait for the stream to end).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, JobError};

use crate::drain::bench_worker;
use crate::options::Options;
use crate::support::{BenchDb, Figures, with_latencies};

const BACKLOG: usize = 2_000;
const LOWS: usize = 20;

/// One run: returns the figures (urgent jobs/s; p50 and p95 of the low jobs' waits), the
/// longest wait and how many low jobs ran before the end (`LOWS` unless starved).
pub fn aging(
    backend: Backend,
    options: &Options,
    after: Option<Duration>,
) -> (Figures, Duration, usize) {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let urgent: Vec<NewJob> = (0..BACKLOG)
        .map(|_| NewJob::new("bench", "urgent", vec![b'x'; options.payload]).priority(-1))
        .collect();
    jobs::enqueue_many(&mut conn, &urgent).expect("fill the stream");
    let pool = db.pool(options.workers as u32 * 2 + 4);
    let producer = pool.clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let (counted, stop) = (runs.clone(), Arc::new(AtomicBool::new(false)));
    let stopped = stop.clone();
    let payload = options.payload;
    let mut builder = bench_worker(pool, options)
        .raw_handler("urgent", move |_: &JobContext, _: &[u8]| {
            counted.fetch_add(1, Ordering::Relaxed);
            if !stopped.load(Ordering::Relaxed) {
                let mut c = producer.get()?;
                let next = NewJob::new("bench", "urgent", vec![b'x'; payload]).priority(-1);
                jobs::enqueue(&mut *c, &next)?;
            }
            Ok::<(), JobError>(())
        })
        .raw_handler("low", |_: &JobContext, _: &[u8]| Ok(()));
    if let Some(after) = after {
        builder = builder.age_priorities(after);
    }
    let worker = builder.start().expect("start the worker");
    let started = Instant::now();
    let mut lows = Vec::new();
    for _ in 0..LOWS {
        let low = NewJob::new("bench", "low", vec![b'x'; options.payload]).priority(10);
        lows.push(
            jobs::enqueue(&mut conn, &low)
                .expect("enqueue a low job")
                .id,
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    // Long enough for every low job within its bound (after + a pass), not for a starved one.
    let deadline =
        Instant::now() + after.map_or(Duration::from_secs(10), |a| a * 3 + Duration::from_secs(10));
    let mut waits = Vec::new();
    while Instant::now() < deadline {
        waits.clear();
        for &id in &lows {
            let job = jobs::get(&mut conn, id)
                .expect("read a low job")
                .expect("a low job");
            if let (JobState::Completed, Some(claimed_at)) = (job.state, job.claimed_at) {
                waits.push((claimed_at - job.due_at).to_std().unwrap_or_default());
            }
        }
        if waits.len() == LOWS {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let rate = runs.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    worker.shutdown(Duration::from_secs(10));
    let longest = waits.iter().max().copied().unwrap_or_default();
    let ran = waits.len();
    (with_latencies(rate, waits), longest, ran)
}

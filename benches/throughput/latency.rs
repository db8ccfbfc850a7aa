//! D: enqueue -> handler start on an idle worker, one job at a time; and what the idle worker
//! costs in CPU.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError};

use crate::drain::bench_worker;
use crate::options::Options;
use crate::support::{BenchDb, Figures, cpu_seconds, with_latencies};

/// D. Enqueue -> handler start on an idle worker, one job at a time.
pub fn latency(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let pool = db.pool(options.workers as u32 + 4);
    let enqueued_at: Arc<Mutex<BTreeMap<i64, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let (seen, sink) = (enqueued_at.clone(), latencies.clone());
    let worker = bench_worker(pool, options)
        .raw_handler("noop", move |ctx: &JobContext, _payload: &[u8]| {
            let now = Instant::now();
            // The enqueuer records the instant before the insert; wait for it if the job
            // started before the enqueuer got its id back.
            loop {
                let at = seen.lock().expect("lock").get(&ctx.id).copied();
                if let Some(at) = at {
                    sink.lock().expect("lock").push(now - at);
                    return Ok::<(), JobError>(());
                }
                std::thread::yield_now();
            }
        })
        .start()
        .expect("start the worker");
    // Let the worker go idle first.
    std::thread::sleep(Duration::from_millis(300));
    let job = NewJob::new("bench", "noop", vec![b'x'; options.payload]);
    for _ in 0..options.samples {
        let before = Instant::now();
        let id = jobs::enqueue(&mut conn, &job).expect("enqueue").id;
        enqueued_at.lock().expect("lock").insert(id, before);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let started = latencies.lock().expect("lock").len();
            if started == enqueued_at.lock().expect("lock").len() {
                break;
            }
            assert!(Instant::now() < deadline, "a job did not start within 10 s");
            std::thread::sleep(Duration::from_micros(200));
        }
        // Idle again between samples, as a real idle worker would be.
        std::thread::sleep(Duration::from_millis(20));
    }
    // What an idle worker costs: CPU time of this process over 2 s with nothing to do.
    let (cpu_before, wall) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let idle = (cpu_seconds() - cpu_before) / wall.elapsed().as_secs_f64();
    IDLE_CPU.lock().expect("lock").push((backend, idle));
    worker.shutdown(Duration::from_secs(10));
    let latencies = latencies.lock().expect("lock").clone();
    with_latencies(0.0, latencies)
}

/// Idle worker CPU use (fraction of one core) per latency run.
pub static IDLE_CPU: Mutex<Vec<(Backend, f64)>> = Mutex::new(Vec::new());

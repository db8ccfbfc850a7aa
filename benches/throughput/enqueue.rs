//! A, B and B2: enqueueing, one job per transaction or all jobs in one bulk call (B2: each
//! with a dedup key); and the jobs every workload enqueues.

use std::time::Instant;

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::options::Options;
use crate::support::{BenchDb, Figures, with_latencies};

pub fn batch(options: &Options, queue: &str, n: usize) -> Vec<NewJob> {
    (0..n)
        .map(|_| NewJob::new(queue, "noop", vec![b'x'; options.payload]))
        .collect()
}

/// A. One job per transaction (one statement on a bare connection), one client.
pub fn enqueue_one_by_one(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let job = NewJob::new("bench", "noop", vec![b'x'; options.payload]);
    let mut latencies = Vec::with_capacity(options.jobs);
    let started = Instant::now();
    for _ in 0..options.jobs {
        let t = Instant::now();
        jobs::enqueue(&mut conn, &job).expect("enqueue");
        latencies.push(t.elapsed());
    }
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        latencies,
    )
}

/// Z1. One job per transaction, each on one of `keys` sequence keys in turn.
pub fn enqueue_sequenced(backend: Backend, options: &Options, keys: usize) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let mut latencies = Vec::with_capacity(options.jobs);
    let started = Instant::now();
    for i in 0..options.jobs {
        let job = NewJob::new("bench", "noop", vec![b'x'; options.payload])
            .sequence(format!("key-{}", i % keys));
        let t = Instant::now();
        jobs::enqueue(&mut conn, &job).expect("enqueue");
        latencies.push(t.elapsed());
    }
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        latencies,
    )
}

/// B. All jobs in one `enqueue_many` call.
pub fn enqueue_bulk(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let jobs = batch(options, "bench", options.jobs);
    let started = Instant::now();
    jobs::enqueue_many(&mut conn, &jobs).expect("enqueue_many");
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        vec![],
    )
}

/// B2. All jobs in one `enqueue_many` call, each with a dedup key (a retry-safe bulk
/// enqueue).
pub fn enqueue_bulk_keyed(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let jobs: Vec<NewJob> = batch(options, "bench", options.jobs)
        .into_iter()
        .enumerate()
        .map(|(i, job)| job.dedup_key(format!("key-{i}")))
        .collect();
    let started = Instant::now();
    jobs::enqueue_many(&mut conn, &jobs).expect("enqueue_many");
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        vec![],
    )
}

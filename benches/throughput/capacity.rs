//! P: the drain at capacity over time. A producer keeps about 1,000 jobs due (it tops the
//! queue up in bulk whenever the depth falls below that), a worker drains as fast as it can
//! and prunes completed jobs (retention: keep those younger than 10 s, as in G), for
//! `--capacity-secs` (default 300). Every window prints the jobs completed a second, the due
//! depth, dead row versions and the tables' size; the end prints the rate of the last minute
//! against the first (issue 33's target: at least 0.9, where one table of jobs claimed and
//! finished in place sank to about 0.4 without autovacuum).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tenure::jobs::{self, Finished, NewJob, Retention};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend};

use crate::chart::{self, Series};
use crate::steady::{autovacuum, ring_generation, table_readings};
use crate::support::BenchDb;

/// The due depth the producer keeps.
const KEEP_DUE: u32 = 1_000;

pub fn capacity(backend: Backend, secs: u64, window_secs: u64, threads: usize) {
    let db = Arc::new(BenchDb::new(backend));
    let completed = Arc::new(AtomicU64::new(0));
    let counter = completed.clone();
    let worker = Worker::builder(db.pool(threads as u32 + 4))
        .queue("bench")
        .threads(threads)
        .retention(
            "bench",
            Finished::Completed,
            Retention::KeepYoungerThan(Duration::from_secs(10)),
        )
        .raw_handler("noop", move |_: &JobContext, _: &[u8]| {
            counter.fetch_add(1, Ordering::Relaxed);
            Ok::<(), JobError>(())
        })
        .start()
        .expect("start the worker");
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (db, stop) = (db.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut conn = db.connect();
            while !stop.load(Ordering::Relaxed) {
                let due = jobs::queue_depth(&mut conn, "bench", KEEP_DUE * 2)
                    .expect("queue_depth")
                    .due;
                if due >= u64::from(KEEP_DUE) {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                let batch: Vec<NewJob> = (due..u64::from(KEEP_DUE))
                    .map(|_| NewJob::new("bench", "noop", vec![0; 16]))
                    .collect();
                jobs::enqueue_many(&mut conn, &batch).expect("top the queue up");
            }
        })
    };
    let mut watch: AnyConnection = db.connect();
    let sqlite_path = (backend == Backend::Sqlite).then(|| db.url().to_string());
    let vacuum = if backend == Backend::Postgres {
        format!(", autovacuum {}", autovacuum(&mut watch))
    } else {
        String::new()
    };
    println!();
    println!(
        "P on {backend:?}: {KEEP_DUE} due kept, {threads} worker threads, {secs} s, windows of {window_secs} s{vacuum}"
    );
    println!("| t (s) | jobs/s | due depth | dead versions | size (MB) | rotations |");
    println!("|---|---|---|---|---|---|");
    let started = Instant::now();
    let mut rates: Vec<(u64, f64)> = Vec::new();
    // (t, dead versions, size MB) per window, for the chart.
    let mut readings: Vec<(f64, f64, f64)> = Vec::new();
    let mut last = (Instant::now(), 0);
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(window_secs));
        let now = (Instant::now(), completed.load(Ordering::Relaxed));
        let rate = (now.1 - last.1) as f64 / now.0.duration_since(last.0).as_secs_f64();
        last = now;
        let t = started.elapsed().as_secs();
        rates.push((t, rate));
        let depth = jobs::queue_depth(&mut watch, "bench", jobs::MAX_DEPTH_BOUND)
            .map_or(-1, |d| d.due as i64);
        let (dead, size) = table_readings(&mut watch, backend, sqlite_path.as_deref());
        let rotations = ring_generation(&mut watch, backend);
        readings.push((t as f64, dead as f64, size as f64 / 1e6));
        println!(
            "| {t} | {rate:.0} | {depth} | {dead} | {:.1} | {rotations} |",
            size as f64 / 1e6
        );
    }
    stop.store(true, Ordering::Relaxed);
    producer.join().expect("the producer panicked");
    worker.shutdown(Duration::from_secs(10));
    let charted = chart::write(
        &format!("p-{backend:?}-{secs}s").to_lowercase(),
        &format!("P on {backend:?}: {KEEP_DUE} due kept, {threads} threads{vacuum}"),
        &[
            Series {
                label: "jobs completed a second".into(),
                points: rates.iter().map(|(t, r)| (*t as f64, *r)).collect(),
            },
            Series {
                label: "dead row versions (or the backend's reading)".into(),
                points: readings.iter().map(|r| (r.0, r.1)).collect(),
            },
            Series {
                label: "tables and indexes (MB)".into(),
                points: readings.iter().map(|r| (r.0, r.2)).collect(),
            },
        ],
        None,
    );
    match charted {
        Ok(path) => println!("P on {backend:?}: chart {}", path.display()),
        Err(e) => println!("P on {backend:?}: no chart ({e})"),
    }
    let minute = 60.min(secs / 2).max(window_secs);
    let mean = |from: u64, to: u64| {
        let window: Vec<f64> = rates
            .iter()
            .filter(|(t, _)| *t > from && *t <= to)
            .map(|(_, r)| *r)
            .collect();
        window.iter().sum::<f64>() / window.len().max(1) as f64
    };
    let end = rates.last().map_or(0, |(t, _)| *t);
    let (first, final_minute) = (mean(0, minute), mean(end.saturating_sub(minute), end));
    println!(
        "P on {backend:?}: first {minute} s {first:.0} jobs/s, last {minute} s {final_minute:.0} jobs/s ({:.2}x)",
        final_minute / first.max(1.0)
    );
}

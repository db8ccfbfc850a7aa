//! F: a fleet. N jobs drained by worker processes (this harness started again with
//! `--fleet-child`), each with its own pool, listener and claimer: 1 process x 16 threads,
//! 2 x 8 and 4 x 4. The rate is over the whole drain, from the children's start to the last
//! one's exit (each exits when the queue is empty).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};

use crate::support::{BenchDb, Figures, with_latencies};

/// (processes, threads each) measured.
pub const SHAPES: [(usize, usize); 3] = [(1, 16), (2, 8), (4, 4)];

/// The child: `--fleet-child URL THREADS`. Runs a worker on the bench queue until the queue
/// has nothing waiting or running, then exits.
pub fn child(mut args: impl Iterator<Item = String>) -> ! {
    let url = args.next().expect("a URL");
    let threads: usize = args.next().and_then(|t| t.parse().ok()).expect("threads");
    let pool = tenure::Pool::options()
        .max_size(threads as u32 + 4)
        .open(&url)
        .expect("open a pool");
    let mut watch = tenure::AnyConnection::connect(&url).expect("connect");
    let worker = Worker::builder(pool)
        .queue("bench")
        .threads(threads)
        .raw_handler("noop", |_: &JobContext, _: &[u8]| Ok::<(), JobError>(()))
        .start()
        .expect("start the worker");
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let depth = jobs::queue_depth(&mut watch, "bench", 1).expect("queue_depth");
        if depth.waiting == 0 && depth.running == 0 {
            break;
        }
    }
    worker.shutdown(Duration::from_secs(10));
    std::process::exit(0);
}

/// `jobs` jobs drained by `processes` worker processes of `threads` threads each.
pub fn fleet(backend: Backend, jobs: usize, processes: usize, threads: usize) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let mut left = jobs;
    while left > 0 {
        let n = left.min(10_000);
        let batch: Vec<NewJob> = (0..n)
            .map(|_| NewJob::new("bench", "noop", vec![]))
            .collect();
        jobs::enqueue_many(&mut conn, &batch).expect("fill");
        left -= n;
    }
    let exe = std::env::current_exe().expect("this harness's path");
    let started = Instant::now();
    let children: Vec<Child> = (0..processes)
        .map(|_| {
            Command::new(&exe)
                .args(["--fleet-child", db.url(), &threads.to_string()])
                .spawn()
                .expect("start a worker process")
        })
        .collect();
    for mut child in children {
        let status = child.wait().expect("wait for a worker process");
        assert!(status.success(), "a worker process failed: {status}");
    }
    let took = started.elapsed();
    let done = jobs::stats(&mut conn)
        .expect("stats")
        .queues
        .iter()
        .map(|q| q.completed)
        .sum::<i64>();
    assert_eq!(done as usize, jobs, "every job completed once");
    with_latencies(jobs as f64 / took.as_secs_f64(), vec![])
}

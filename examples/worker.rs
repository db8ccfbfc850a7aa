//! A worker on threads, stopped gracefully by Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo run --example worker                       # embedded SQLite file
//! cargo run --example worker --all-features -- postgres://root@127.0.0.1/test
//! ```
//!
//! It enqueues 200 "resize" jobs (some fail once and are retried, one panics, one has a
//! payload that does not decode), runs a worker with 4 threads, prints progress, and on
//! Ctrl-C/SIGTERM (or once the queue is empty) stops claiming, lets running jobs finish for
//! up to 5 seconds, gives back the rest, and prints what happened.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dibs::jobs::{self, Backoff, NewJob};
use dibs::worker::{JobContext, JobError, Worker};

#[derive(serde::Serialize, serde::Deserialize)]
struct Resize {
    image: u32,
    width: u32,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "dibs-worker.db".to_string());
    let pool = dibs::Pool::options().max_size(8).open(&url)?;
    dibs::run_migrations(&mut pool.get()?)?;

    let mut batch: Vec<NewJob> = (0..200)
        .map(|image| {
            NewJob::json("images", "resize", &Resize { image, width: 640 })
                .map(|job| job.max_attempts(3))
        })
        .collect::<Result<_, _>>()?;
    batch.push(NewJob::new("images", "resize", b"not json".to_vec()));
    jobs::enqueue_many(&mut pool.get()?, &batch)?;

    // The worker catches handler panics (the job fails with the message); print them briefly.
    std::panic::set_hook(Box::new(|info| eprintln!("  handler panicked: {info}")));

    let stop = Arc::new(AtomicBool::new(false));
    let on_signal = stop.clone();
    ctrlc::set_handler(move || on_signal.store(true, Ordering::SeqCst))?;

    let worker = Worker::builder(pool.clone())
        .queue("images")
        .threads(4)
        .poll_interval(Duration::from_millis(200))
        .backoff(Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
        })
        .handler("resize", |ctx: &JobContext, job: Resize| {
            if job.image == 13 {
                panic!("image 13 is cursed");
            }
            if job.image % 10 == 0 && ctx.attempt == 1 {
                return Err(JobError::retry(format!("image {} was busy", job.image)));
            }
            std::thread::sleep(Duration::from_millis(10)); // the work
            Ok(())
        })
        .start()?;

    println!("working on {} jobs; Ctrl-C to stop early", batch.len());
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let report = worker.report();
        println!(
            "  completed {:>3}  retried {:>2}  dead {}  panicked {}",
            report.completed, report.retried, report.dead, report.panicked
        );
        if stop.load(Ordering::SeqCst) || report.completed + report.dead >= batch.len() {
            break;
        }
    }
    let report = worker.shutdown(Duration::from_secs(5));
    println!("stopped: {report:?}");
    Ok(())
}

//! A worker on threads, stopped gracefully by Ctrl-C or SIGTERM.
//!
//! ```text
//! cargo run --example worker                       # embedded SQLite file
//! cargo run --example worker --all-features -- postgres://root@127.0.0.1/test
//! ```
//!
//! It enqueues 200 typed "resize" jobs (some fail once and are retried, one panics, one has a
//! payload that does not decode), runs a worker with 4 threads, prints progress, and on
//! Ctrl-C/SIGTERM (or once the queue is empty) stops claiming, lets running jobs finish for
//! up to 5 seconds, gives back the rest, and prints what happened. Its handler is a plain
//! function with unit tests (`tenure::testing`), run by `cargo test --example worker`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tenure::jobs::{self, Backoff, JobArgs, NewJob};
use tenure::worker::{JobContext, JobError, Worker};

/// A typed job: its kind, queue and options, declared once.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Resize {
    image: u32,
    width: u32,
}

impl JobArgs for Resize {
    const KIND: &'static str = "resize";
    const QUEUE: &'static str = "images";
    const MAX_ATTEMPTS: u32 = 3;
    const BACKOFF: Option<Backoff> = Some(Backoff {
        base: Duration::from_millis(100),
        max: Duration::from_secs(1),
    });
}

/// The handler, a plain function: unit-tested below without a worker.
fn resize(ctx: &JobContext, job: Resize) -> Result<(), JobError> {
    if job.image == 13 {
        panic!("image 13 is cursed");
    }
    if job.width == 0 {
        return Err(JobError::dead("width 0: retrying cannot help"));
    }
    if job.image % 10 == 0 && ctx.attempt == 1 {
        return Err(JobError::retry(format!("image {} was busy", job.image)));
    }
    std::thread::sleep(Duration::from_millis(10)); // the work
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tenure-worker.db".to_string());
    let pool = tenure::Pool::options().max_size(8).open(&url)?;
    tenure::run_migrations(&mut pool.get()?)?;

    let images: Vec<Resize> = (0..200).map(|image| Resize { image, width: 640 }).collect();
    jobs::enqueue_jobs(&mut pool.get()?, &images)?;
    // A payload that is not a Resize: dead at once, its error naming the type.
    jobs::enqueue(
        &mut pool.get()?,
        &NewJob::new(Resize::QUEUE, Resize::KIND, b"not json".to_vec()),
    )?;
    let total = images.len() + 1;

    // The worker catches handler panics (the job fails with the message); print them briefly.
    std::panic::set_hook(Box::new(|info| eprintln!("  handler panicked: {info}")));

    let stop = Arc::new(AtomicBool::new(false));
    let on_signal = stop.clone();
    ctrlc::set_handler(move || on_signal.store(true, Ordering::SeqCst))?;

    let worker = Worker::builder(pool.clone())
        .threads(4)
        .poll_interval(Duration::from_millis(200))
        .register(resize)
        .start()?;

    println!("working on {total} jobs; Ctrl-C to stop early");
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let report = worker.report();
        println!(
            "  completed {:>3}  retried {:>2}  dead {}  panicked {}",
            report.completed, report.retried, report.dead, report.panicked
        );
        if stop.load(Ordering::SeqCst) || report.completed + report.dead >= total {
            break;
        }
    }
    let report = worker.shutdown(Duration::from_secs(5));
    println!(
        "stopped: {} completed, {} retried, {} dead ({} panicked), {} given back",
        report.completed, report.retried, report.dead, report.panicked, report.given_back
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure::testing;

    #[test]
    fn a_width_of_zero_is_dead_at_once() {
        let error = resize(
            &testing::job_context::<Resize>(),
            Resize { image: 1, width: 0 },
        )
        .expect_err("refused");
        assert!(error.is_dead(), "{error:?}");
    }

    #[test]
    fn a_busy_image_is_retried_once() {
        let mut ctx = testing::job_context::<Resize>();
        let busy = Resize {
            image: 10,
            width: 64,
        };
        assert!(!resize(&ctx, busy).expect_err("busy").is_dead());
        ctx.attempt = 2;
        assert!(
            resize(
                &ctx,
                Resize {
                    image: 10,
                    width: 64
                }
            )
            .is_ok()
        );
    }

    #[test]
    fn enqueued_resizes_are_drained() -> Result<(), tenure::Error> {
        let pool = tenure::Pool::options().max_size(1).open(":memory:")?;
        tenure::run_migrations(&mut pool.get()?)?;
        jobs::enqueue_job(
            &mut pool.get()?,
            &Resize {
                image: 1,
                width: 64,
            },
        )?;
        testing::assert_enqueued(
            &mut pool.get()?,
            &Resize {
                image: 1,
                width: 64,
            },
        );
        let report = testing::drain(Worker::builder(pool.clone()).register(resize))?;
        assert_eq!(report.completed, 1);
        assert!(testing::enqueued::<Resize, _>(&mut pool.get()?)?.is_empty());
        Ok(())
    }
}

//! A worker's metrics in Prometheus's text format, through the `metrics` facade and
//! `metrics-exporter-prometheus` (the `metrics` feature).
//!
//! ```text
//! cargo run --example metrics --features metrics            # embedded SQLite file
//! cargo run --example metrics --all-features -- postgres://root@127.0.0.1/test
//! ```
//!
//! It installs a Prometheus recorder, enqueues typed jobs (some fail once, one is dead at
//! once, one snoozes), runs them through a worker with a tracing log line per job, sets the
//! queue gauges from `jobs::stats`, and prints what a scrape of `/metrics` would return. A
//! real service serves `handle.render()` on its HTTP endpoint (or uses the exporter's own
//! listener) and calls `tenure::metrics::record_stats` every few seconds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;
use tenure::jobs::{self, Backoff, JobArgs};
use tenure::worker::{JobContext, JobError, Worker};

#[derive(serde::Serialize, serde::Deserialize)]
struct Thumbnail {
    image: u32,
}

impl JobArgs for Thumbnail {
    const KIND: &'static str = "thumbnail";
    const QUEUE: &'static str = "images";
    const BACKOFF: Option<Backoff> = Some(Backoff {
        base: Duration::from_millis(10),
        max: Duration::from_millis(10),
    });
}

static SNOOZED: AtomicBool = AtomicBool::new(false);

fn thumbnail(ctx: &JobContext, job: Thumbnail) -> Result<(), JobError> {
    match job.image {
        0 => Err(JobError::dead("image 0 is missing")),
        7 if ctx.attempt == 1 => Err("the image store timed out")?,
        // Not ready yet: back in a moment, without using an attempt.
        9 if !SNOOZED.swap(true, Ordering::SeqCst) => {
            Err(JobError::snooze(Duration::from_millis(5)))
        }
        _ => Ok(()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tenure-metrics.db".to_string());
    let handle = PrometheusBuilder::new().install_recorder()?;
    tracing_subscriber_init();

    let pool = tenure::Pool::options().max_size(8).open(&url)?;
    tenure::run_migrations(&mut pool.get()?)?;
    let images: Vec<Thumbnail> = (0..20).map(|image| Thumbnail { image }).collect();
    jobs::enqueue_jobs(&mut pool.get()?, &images)?;

    // A drain runs what is due; the retry and the snooze are due a few ms later.
    for _ in 0..3 {
        let r = Worker::builder(pool.clone()).register(thumbnail).drain()?;
        eprintln!(
            "drained: {} completed, {} retried, {} snoozed, {} dead",
            r.completed, r.retried, r.snoozed, r.dead
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    tenure::metrics::record_stats(&jobs::stats(&mut pool.get()?)?);

    let text = handle.render();
    println!("{text}");
    // What the example promises: every run counted by outcome.
    for expected in [
        "tenure_job_runs_total{queue=\"images\",kind=\"thumbnail\",outcome=\"dead\"}",
        "tenure_job_runs_total{queue=\"images\",kind=\"thumbnail\",outcome=\"completed\"}",
        "tenure_jobs_enqueued_total{queue=\"images\"}",
        "tenure_job_run_seconds",
        "tenure_jobs{queue=\"images\",state=\"waiting\"}",
    ] {
        if !text.contains(expected) {
            return Err(format!("the scrape lacks {expected}").into());
        }
    }
    Ok(())
}

/// A log line per job on stderr (`RUST_LOG=tenure=debug` for more).
fn tracing_subscriber_init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

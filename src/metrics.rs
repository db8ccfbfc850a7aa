//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (the `metrics` feature):
//! install any recorder (`metrics-exporter-prometheus`, `metrics-exporter-statsd`, ...) and
//! workers count what they do. Without a recorder the calls cost next to nothing; without
//! the feature there are none.
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `tenure_jobs_enqueued_total` | counter | `queue` | jobs enqueued by this process (counted when the insert returns: a transaction rolled back later still counts) |
//! | `tenure_job_runs_total` | counter | `queue`, `kind`, `outcome` | runs recorded, by [`RunOutcome`] (`completed`, `retried`, `dead`, `snoozed`, `cancelled`, `lost`, `given_back`) |
//! | `tenure_job_run_seconds` | histogram | `queue`, `kind` | how long handlers ran |
//! | `tenure_job_queue_wait_seconds` | histogram | `queue`, `kind` | from a job's due time to its claim (database clock) |
//! | `tenure_jobs_rescued_total` | counter | `result` (`requeued`, `dead`, `cancelled`) | jobs whose claims lapsed, returned by this process's workers |
//! | `tenure_jobs_pruned_total` | counter | `queue` | finished jobs deleted by retention |
//! | `tenure_jobs_aged_total` | counter | `queue` | waiting jobs moved to the front by priority aging |
//! | `tenure_jobs` | gauge | `queue`, `state` | jobs per state, from [`record_stats`] |
//! | `tenure_queue_oldest_waiting_seconds` | gauge | `queue` | the longest wait of a due job, from [`record_stats`] |
//! | `tenure_queue_paused` | gauge | `queue` | 1 while paused, from [`record_stats`] |
//!
//! `tenure_jobs_enqueued_total` is counted where jobs are enqueued (`jobs::queue::enqueue`),
//! so that the queue does not depend on this module; the others are counted here.
//!
//! Counters say what this process did; the gauges say what the database holds, so call
//! [`record_stats`] with [`crate::jobs::stats`] from one place (every few seconds, or when
//! scraped).
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! let mut conn = tenure::AnyConnection::connect(":memory:")?;
//! tenure::run_migrations(&mut conn)?;
//! // With a recorder installed, this sets the gauges:
//! tenure::metrics::record_stats(&tenure::jobs::stats(&mut conn)?);
//! # Ok(()) }
//! ```

use metrics::{counter, gauge, histogram};

use crate::events::{Event, RunOutcome};
use crate::jobs::Stats;

/// Sets the gauges from a [`crate::jobs::stats`] reading: jobs per queue and state, the
/// oldest due job's wait, and whether the queue is paused.
pub fn record_stats(stats: &Stats) {
    for queue in &stats.queues {
        let name = queue.queue.clone();
        for (state, n) in [
            ("waiting", queue.waiting),
            ("running", queue.running),
            ("parked", queue.parked),
            ("completed", queue.completed),
            ("dead", queue.dead),
            ("cancelled", queue.cancelled),
        ] {
            gauge!("tenure_jobs", "queue" => name.clone(), "state" => state).set(n as f64);
        }
        let oldest = queue.oldest_waiting.num_milliseconds() as f64 / 1000.0;
        gauge!("tenure_queue_oldest_waiting_seconds", "queue" => name.clone()).set(oldest);
        gauge!("tenure_queue_paused", "queue" => name).set(if queue.paused { 1.0 } else { 0.0 });
    }
}

/// Counts a worker's event.
pub(crate) fn record_event(event: &Event) {
    match event {
        Event::Run(run) => {
            // Shared, not copied: a run's labels cost no allocation of their text.
            let (queue, kind) = (run.queue.clone(), run.kind.clone());
            counter!(
                "tenure_job_runs_total",
                "queue" => queue.clone(),
                "kind" => kind.clone(),
                "outcome" => run.outcome.as_str()
            )
            .increment(1);
            if let Some(run_time) = run.run_time {
                histogram!("tenure_job_run_seconds", "queue" => queue.clone(), "kind" => kind.clone())
                    .record(run_time.as_secs_f64());
            }
            if run.outcome != RunOutcome::GivenBack {
                histogram!("tenure_job_queue_wait_seconds", "queue" => queue, "kind" => kind)
                    .record(run.queue_wait.as_secs_f64());
            }
        }
        Event::Rescued {
            requeued,
            dead,
            cancelled,
        } => {
            for (result, n) in [
                ("requeued", requeued),
                ("dead", dead),
                ("cancelled", cancelled),
            ] {
                counter!("tenure_jobs_rescued_total", "result" => result).increment(*n as u64);
            }
        }
        Event::Pruned { queue, deleted } => {
            counter!("tenure_jobs_pruned_total", "queue" => queue.clone())
                .increment(*deleted as u64);
        }
        Event::Aged { queue, jobs } => {
            counter!("tenure_jobs_aged_total", "queue" => queue.clone()).increment(*jobs as u64);
        }
        Event::SchedulesFired { .. } => {}
    }
}

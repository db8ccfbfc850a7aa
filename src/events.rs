//! What a worker does, as it happens: one [`Event`] per recorded run and per maintenance
//! pass, given to the hooks of [`crate::worker::WorkerBuilder::on_event`], logged through
//! `tracing` and, with the `metrics` feature, counted through the `metrics` facade
//! ([`crate::metrics`]).
//!
//! ## Tracing
//!
//! | what | kind | target | level | fields |
//! |---|---|---|---|---|
//! | a run | span `tenure.job` | `tenure::worker` | INFO | `job.id`, `queue`, `kind`, `attempt`, `queue_wait_ms`; recorded at its end: `result` (`ok`, `error`, `panic`), `run_ms` |
//! | a run recorded | event | `tenure::job` | INFO (WARN when dead or lost) | `job.id`, `queue`, `kind`, `attempt`, `max_attempts`, `outcome`, `run_ms`, `queue_wait_ms`, `error` |
//! | a claim | event | `tenure::worker` | DEBUG | `queue`, `jobs` |
//! | a rescue | event | `tenure::worker` | INFO | `requeued`, `dead`, `cancelled` |
//! | a prune | event | `tenure::worker` | DEBUG | `queue`, `deleted` |
//! | schedules fired | event | `tenure::worker` | DEBUG | `enqueued` |
//! | a claim ended under a run (lost, cancelled) | event | `tenure::worker` | WARN | `job.id`, `outcome` |
//! | a lease lost ([`crate::LeaseGuard`]) | event | `tenure::lease` | WARN | `lease`, `reason` |
//!
//! Failures of the worker's own statements (a claim, a heartbeat, a record) are WARN events
//! with an `error` field; the worker retries them.

use std::sync::Arc;
use std::time::Duration;

/// Something a worker did. Hooks get every event of their worker, on the worker's own
/// threads: keep them quick (hand slow work to a channel).
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tenure::worker::{Event, RunOutcome};
///
/// let dead = Arc::new(Mutex::new(Vec::new()));
/// let seen = dead.clone();
/// let hook = move |event: &Event| {
///     if let Event::Run(run) = event {
///         if run.outcome == RunOutcome::Dead {
///             seen.lock().unwrap().push(run.id);
///         }
///     }
/// };
/// // Worker::builder(pool).on_event(hook) ...
/// # let _ = hook;
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// A run ended and how it ended is recorded in the database.
    Run(RunEvent),
    /// A rescue pass of this worker returned jobs whose worker died (its lock was released)
    /// or whose claims had lapsed (a worker stalled): counts of jobs back in the queue, dead
    /// (too many lapses), and cancelled.
    Rescued {
        /// Back in the queue, due at once.
        requeued: usize,
        /// Dead: their claims lapsed [`crate::jobs::MAX_LAPSES`] times.
        dead: usize,
        /// Cancelled: asked to cancel while they ran.
        cancelled: usize,
    },
    /// This worker deleted finished jobs of a queue per its retention policy.
    Pruned {
        /// The queue.
        queue: String,
        /// How many jobs.
        deleted: usize,
    },
    /// This worker moved jobs of a queue that waited too long to the front
    /// ([`crate::worker::WorkerBuilder::age_priorities`]).
    Aged {
        /// The queue.
        queue: String,
        /// How many jobs.
        jobs: usize,
    },
    /// This worker fired recurring schedules.
    SchedulesFired {
        /// How many jobs they enqueued.
        enqueued: usize,
    },
}

/// One recorded run of a job.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RunEvent {
    /// The job's id.
    pub id: i64,
    /// Its queue.
    pub queue: Arc<str>,
    /// Its kind.
    pub kind: Arc<str>,
    /// Which run this was (1 for the first).
    pub attempt: u32,
    /// How many runs it may have.
    pub max_attempts: u32,
    /// How it ended.
    pub outcome: RunOutcome,
    /// The error of a run that did not succeed.
    pub error: Option<String>,
    /// How long the handler ran (`None` for a job given back unstarted).
    pub run_time: Option<Duration>,
    /// From the job's due time to this claim (database clock).
    pub queue_wait: Duration,
    /// The handler panicked.
    pub panicked: bool,
    /// The run passed its kind's timeout.
    pub timed_out: bool,
}

/// How a run ended, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RunOutcome {
    /// The job completed.
    Completed,
    /// The run failed; the job waits for its retry.
    Retried,
    /// The job is dead: it failed for good, its attempts ran out, or its payload did not
    /// decode.
    Dead,
    /// The handler snoozed the job ([`crate::worker::JobError::snooze`]).
    Snoozed,
    /// The job was cancelled while it ran.
    Cancelled,
    /// The claim was lost before the run was recorded (rescued or taken over): another run
    /// decides.
    Lost,
    /// Given back: claimed ahead and not started at shutdown, or stopped when asked to.
    GivenBack,
    /// Parked ([`crate::worker::JobError::parked`]): the job waits for its token's answer.
    Parked,
}

impl RunOutcome {
    /// The outcome as a word: `completed`, `retried`, `dead`, `snoozed`, `cancelled`, `lost`,
    /// `given_back`, `parked`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunOutcome::Completed => "completed",
            RunOutcome::Retried => "retried",
            RunOutcome::Dead => "dead",
            RunOutcome::Snoozed => "snoozed",
            RunOutcome::Cancelled => "cancelled",
            RunOutcome::Lost => "lost",
            RunOutcome::GivenBack => "given_back",
            RunOutcome::Parked => "parked",
        }
    }
}

/// A hook given to [`crate::worker::WorkerBuilder::on_event`].
pub(crate) type Hook = Arc<dyn Fn(&Event) + Send + Sync>;

/// A duration in milliseconds, to the microsecond: `6278.0`, never `6278.000000000001`.
pub(crate) fn milliseconds(d: Duration) -> f64 {
    (d.as_secs_f64() * 1_000_000.0).round() / 1000.0
}

/// Logs an event as the table above says.
pub(crate) fn log(event: &Event) {
    let ms = milliseconds;
    match event {
        Event::Run(run) => {
            let run_ms = run.run_time.map(ms);
            macro_rules! run_event {
                ($level:expr) => {
                    tracing::event!(
                        target: "tenure::job",
                        $level,
                        job.id = run.id,
                        queue = %run.queue,
                        kind = %run.kind,
                        attempt = run.attempt,
                        max_attempts = run.max_attempts,
                        outcome = %run.outcome.as_str(),
                        run_ms,
                        queue_wait_ms = ms(run.queue_wait),
                        error = run.error.as_deref(),
                        "job {}", run.outcome.as_str()
                    )
                };
            }
            match run.outcome {
                RunOutcome::Dead | RunOutcome::Lost => run_event!(tracing::Level::WARN),
                _ => run_event!(tracing::Level::INFO),
            }
        }
        Event::Rescued {
            requeued,
            dead,
            cancelled,
        } => tracing::info!(
            target: "tenure::worker",
            requeued, dead, cancelled, "rescued jobs whose worker died or whose claims lapsed"
        ),
        Event::Pruned { queue, deleted } => {
            tracing::debug!(target: "tenure::worker", %queue, deleted, "pruned finished jobs")
        }
        Event::Aged { queue, jobs } => {
            tracing::debug!(target: "tenure::worker", %queue, jobs, "aged waiting jobs' priorities")
        }
        Event::SchedulesFired { enqueued } => {
            tracing::debug!(target: "tenure::worker", enqueued, "fired schedules")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_print_as_people_write_them() {
        let logged = format!("{:?}", milliseconds(Duration::from_micros(6_278_000)));
        assert_eq!(logged, "6278.0");
        assert_eq!(milliseconds(Duration::from_nanos(1_234_567)), 1.235);
        assert_eq!(
            format!("{:?}", milliseconds(Duration::from_secs_f64(0.3))),
            "300.0"
        );
    }
}

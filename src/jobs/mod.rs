//! The job queue: enqueue, claim, and finish jobs (`tenure_jobs`).
//!
//! A job is *waiting* (due now or later, retries included), *running* (claimed by a worker
//! for a limited time, under a fresh random claim token), *completed* or *dead* (failed for
//! good). Delayed jobs are plain waiting rows with a future due time: there is no promotion
//! pass.
//!
//! | operation | connection | notes |
//! |---|---|---|
//! | [`enqueue`], [`enqueue_many`] | any, joins the caller's transaction | a rolled-back transaction leaves no job |
//! | [`claim`], [`claim_kinds`] | bare | atomic: no job is ever held by two claimers |
//! | [`complete`], [`fail`], [`renew`], [`give_back`], [`snooze`] | any; inside the caller's transaction they commit with it | fenced by the claim token, one [`Outcome`] per job |
//! | [`rescue`] | bare | returns stalled jobs (claim lapsed, or its worker died) to the queue, or marks them dead |
//! | [`get`] | any | a job's state |
//!
//! Handlers run at least once. The only exactly-once there is: the handler's own writes and
//! [`complete`] in one transaction ([`crate::transaction`]), which commits only if the claim
//! is still this worker's.
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! use std::time::Duration;
//! use tenure::jobs::{self, NewJob, Outcome};
//! let mut conn = tenure::AnyConnection::connect(":memory:")?;
//! tenure::run_migrations(&mut conn)?;
//!
//! let id = jobs::enqueue(&mut conn, &NewJob::new("mail", "welcome", b"ada@example.com".to_vec()))?.id;
//! let claimed = jobs::claim(&mut conn, "mail", 10, Duration::from_secs(60))?;
//! assert_eq!(claimed[0].id, id);
//! assert_eq!(jobs::complete(&mut conn, &[claimed[0].claim()])?, vec![Outcome::Done]);
//! # Ok(()) }
//! ```

mod admission;
mod batch;
mod claim;
#[cfg(feature = "postgres")]
mod copy_in;
mod dependencies;
mod depth;
mod enqueue;
mod finish;
mod limits;
mod manage;
mod model;
mod new_job;
mod results;
mod retention;
mod typed;
mod workers;
mod workflow;

use diesel::prelude::*;

use crate::backend::dispatch;
use crate::{Error, Result, TenureConnection};

pub use batch::{INSERT_CHUNK_BYTES, INSERT_CHUNK_ROWS, enqueue_many};
pub use claim::{claim, claim_kinds, rescue};
pub(crate) use claim::{claim_kinds_throttled, rescue_lapsed};
pub(crate) use dependencies::settle;
pub use dependencies::{MAX_DEPENDENCIES, MAX_STRIPES, RunWhen, STRIPE_SIZE};
pub use depth::{MAX_DEPTH_BOUND, QueueCounts, QueueDepth, queue_counts, queue_depth};
pub use enqueue::enqueue;
pub(crate) use finish::complete_with_results;
pub(crate) use finish::snooze_noting_death;
pub use finish::{complete, fail, give_back, renew, snooze};
pub use limits::{
    KeyState, Limit, MAX_LIMIT, MAX_LIMITS, Rate, key_states, limit_queue, limits_of, queue_limits,
};
pub use manage::{
    FailedRun, JobFilter, MAX_OUTPUT_BYTES, QueueStats, RunOutput, RunningJob, Stats, cancel,
    history, is_paused, list, outputs, pause, record_output, resume, retry_dead,
    retry_dead_of_kind, stats,
};
use model::IdRow;
pub use model::{Backoff, ClaimedJob, Job, JobClaim, JobState, Outcome, Rescued, Retry};
pub use new_job::{DedupOver, Due, Enqueued, NewJob, OnDuplicate};
pub use results::{
    DependencyResult, JobResult, MAX_PROGRESS_MESSAGE_BYTES, MAX_RESULT_BYTES,
    complete_with_result, dependency_results, dependency_results_after, progress, record_progress,
    result,
};
pub use retention::{Finished, Retention, prune};
pub use typed::{JobArgs, enqueue_job, enqueue_jobs};
pub(crate) use workers::{
    DEAD_WORKERS_EVERY, Registered, Relocked, WORKER_BEAT, beat, holds_lock, register, relock,
    rescue_dead, unregister,
};
pub use workflow::{
    EnqueuedWorkflow, StateCounts, Step, Workflow, WorkflowJob, WorkflowStatus, cancel_workflow,
    enqueue_workflow, workflow_jobs, workflow_status,
};

/// How many errors a job's history keeps (the newest).
pub const MAX_ERROR_HISTORY: usize = 20;

/// The largest payload, in bytes (MariaDB's default `max_allowed_packet` is 16 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 8 * 1024 * 1024;
/// A job whose claim lapsed this many times (its worker died or stalled holding it each
/// time) is dead: a job that takes its worker down cannot loop forever. A lapsed claim uses
/// no attempt, since the worker may have died before the run began.
pub const MAX_LAPSES: u32 = 5;
/// A job's runs may be snoozed ([`snooze`]) this many times without using an attempt; every
/// further snooze uses one (and a job out of attempts is then dead), so a job that snoozes
/// forever cannot stay in the queue forever.
pub const MAX_FREE_SNOOZES: u32 = 100;
/// The most kinds one [`claim_kinds`] takes.
pub const MAX_KINDS: usize = 100;
/// The most attempts a job may have.
pub const MAX_ATTEMPTS: u32 = 1000;
/// The most jobs one claim or one batch call handles.
pub const MAX_BATCH: usize = 1000;
/// Longer error messages are cut to this many bytes (at a character boundary).
pub const MAX_ERROR_BYTES: usize = 4096;

fn ids_of(rows: Vec<IdRow>) -> Vec<i64> {
    rows.into_iter().map(|row| row.id).collect()
}

/// How many jobs one call may claim or rescue: 1 to [`MAX_BATCH`].
fn check_limit(limit: usize) -> Result<i64> {
    if limit == 0 || limit > MAX_BATCH {
        return Err(Error::invalid(
            "limit",
            format!("{limit} is not between 1 and {MAX_BATCH}"),
        ));
    }
    Ok(limit as i64)
}

/// A job as stored, or `None` if there is no job with this id.
pub fn get<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<Job>> {
    use crate::schema::tenure_jobs;
    Ok(dispatch!(conn, c => {
        tenure_jobs::table
            .find(id)
            .select(Job::as_select())
            .get_result(c)
            .optional()
    })?)
}

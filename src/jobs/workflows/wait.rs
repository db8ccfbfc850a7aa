//! Waiting for a workflow (or batch) to end ([`wait_workflow`]): every job of it, callbacks
//! included, completed, dead or cancelled. The waiting is [`crate::jobs::wait`]'s: the
//! waiters of one process share one read per database, and none holds a connection asleep.

use std::time::Duration;

use diesel::prelude::*;

use super::workflow::{WorkflowStatus, workflow_status};
use crate::backend::dispatch;
use crate::jobs::JobState;
use crate::jobs::queue::wait::{POLL_INTERVAL, await_ended, deadline_after};
use crate::schema::tenure_jobs;
use crate::{Error, Pool, Result};

/// Blocks until every job of workflow `id` (its steps and its callbacks) has ended, and
/// returns the workflow's status then; at most `timeout`, after which it is
/// [`Error::WorkflowWaitTimedOut`] with how many jobs had not ended. [`Error::NoSuchWorkflow`]
/// if there is no such workflow. A callback that is not to run (an `on_failure` of a
/// workflow that succeeded) is cancelled when the workflow settles, so it ends too. Ends are
/// read as they are at one instant: a dead job revived by
/// [`retry_dead`](crate::jobs::retry_dead) while the wait goes on is waited for again. Holds
/// no connection of `pool` while it sleeps. A `timeout` too long to add to the clock is
/// [`Error::InvalidInput`].
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("app.db").display().to_string();
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob, Workflow};
/// let pool = tenure::Pool::open(&url)?;
/// tenure::run_migrations(&mut pool.get()?)?;
/// let mut batch = Workflow::new("thumbnails");
/// batch.add(NewJob::new("img", "thumb", vec![]));
/// batch.on_success(NewJob::new("img", "report", vec![]));
/// let id = jobs::enqueue_workflow(&mut pool.get()?, &batch)?.id;
/// let worker = {
///     let pool = pool.clone();
///     std::thread::spawn(move || -> Result<(), tenure::Error> {
///         let mut conn = pool.get()?;
///         for _ in 0..2 { // the step, then the callback it released
///             let job = jobs::claim(&mut conn, "img", 1, Duration::from_secs(60))?.remove(0);
///             jobs::complete(&mut conn, &[job.claim()])?;
///         }
///         Ok(())
///     })
/// };
/// let status = jobs::wait_workflow(&pool, id, Duration::from_secs(30))?;
/// assert_eq!(status.counts.completed, 1);
/// assert_eq!(status.on_success.unwrap().1, jobs::JobState::Completed);
/// # worker.join().unwrap()?;
/// # Ok(()) }
/// ```
pub fn wait_workflow(pool: &Pool, id: i64, timeout: Duration) -> Result<WorkflowStatus> {
    let deadline = deadline_after(timeout)?;
    let mut last_waited: Option<Vec<i64>> = None;
    loop {
        let unfinished = unfinished_jobs(pool, id)?;
        if unfinished.is_empty() {
            return workflow_status(&mut pool.get()?, id)?.ok_or(Error::NoSuchWorkflow { id });
        }
        // The same jobs unfinished right after the board said they ended: another waiter's
        // read of a job since revived. Let a poll interval pass rather than spin.
        if last_waited.as_ref() == Some(&unfinished) {
            std::thread::sleep(
                POLL_INTERVAL.min(deadline.saturating_duration_since(std::time::Instant::now())),
            );
        }
        match await_ended(pool, &unfinished, deadline)? {
            Some(_) => last_waited = Some(unfinished),
            None => {
                let left = unfinished_jobs(pool, id)?;
                if left.is_empty() {
                    return workflow_status(&mut pool.get()?, id)?
                        .ok_or(Error::NoSuchWorkflow { id });
                }
                return Err(Error::WorkflowWaitTimedOut {
                    id,
                    unfinished: left.len(),
                });
            }
        }
    }
}

/// The ids of the workflow's jobs not ended, in id order; [`Error::NoSuchWorkflow`] if it has
/// no job at all (never enqueued, or pruned: a workflow's row goes with its last job).
fn unfinished_jobs(pool: &Pool, id: i64) -> Result<Vec<i64>> {
    let mut conn = pool.get()?;
    let (any, unfinished) = dispatch!(&mut *conn, c => {
        let any: Option<i64> = tenure_jobs::table
            .filter(tenure_jobs::workflow_id.eq(id))
            .select(tenure_jobs::id)
            .first(c)
            .optional()?;
        let unfinished: Vec<i64> = tenure_jobs::table
            .filter(tenure_jobs::workflow_id.eq(id))
            .filter(tenure_jobs::state.ne_all([JobState::Completed, JobState::Dead, JobState::Cancelled]))
            .select(tenure_jobs::id)
            .order(tenure_jobs::id)
            .load(c)?;
        Ok::<_, Error>((any, unfinished))
    })?;
    match any {
        None => Err(Error::NoSuchWorkflow { id }),
        Some(_) => Ok(unfinished),
    }
}

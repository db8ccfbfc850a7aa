//! What a handler gets ([`JobContext`]) and what it returns when a run does not succeed
//! ([`JobError`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::jobs::{Backoff, DependencyResult, JobClaim, JobResult, ParkToken};
use crate::{Error, Pool, Result};

/// Why a handler's run did not succeed, and what to do about it.
///
/// `?` works in handlers on anything that converts into a
/// `Box<dyn std::error::Error + Send + Sync>`: every error type that is `Send + Sync`
/// (diesel's, tenure's, `std::io::Error`, ...), `String`, `&str`, the box itself, and
/// `anyhow::Error`. Such an error is a retry per the kind's policy ([`JobError::retry`]).
///
/// ```
/// use tenure::worker::{JobContext, JobError};
///
/// fn handler(_ctx: &JobContext, path: String) -> Result<(), JobError> {
///     if path.is_empty() {
///         return Err(JobError::dead("no path: retrying cannot help"));
///     }
///     let _bytes = std::fs::read(&path)?; // an io::Error: retried per policy
///     Err("not finished yet")?             // a &str: retried per policy
/// }
/// ```
pub struct JobError {
    pub(crate) message: String,
    pub(crate) action: Action,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Action {
    /// Retry per the kind's policy.
    Retry,
    /// Retry at this instant.
    RetryAt(DateTime<Utc>),
    /// Dead now.
    Dead,
    /// Back in the queue after this long, without using an attempt.
    Snooze(Duration),
    /// Parked, by the park the run recorded ([`JobContext::park`]).
    Park,
}

impl JobError {
    /// Retry per the kind's retry policy (attempts permitting); dead when they are used up.
    pub fn retry(message: impl Into<String>) -> Self {
        JobError {
            message: message.into(),
            action: Action::Retry,
        }
    }

    /// Retry at `at` (attempts permitting): an instant in the years 1 to 9999, else the
    /// run is retried per the kind's policy and the job's error says why.
    pub fn retry_at(message: impl Into<String>, at: DateTime<Utc>) -> Self {
        JobError {
            message: message.into(),
            action: Action::RetryAt(at),
        }
    }

    /// The job is dead now, whatever attempts it has left: retrying cannot help.
    pub fn dead(message: impl Into<String>) -> Self {
        JobError {
            message: message.into(),
            action: Action::Dead,
        }
    }

    /// Not now: the job goes back to the queue, due after `delay` (database clock), and this
    /// run does not use an attempt (like River's `JobSnooze` or Oban's `{:snooze, s}`), for
    /// a handler that finds the job cannot run yet (a resource busy, a result not ready).
    ///
    /// Bounded, so a job cannot snooze forever unnoticed: every snooze is counted
    /// ([`crate::jobs::Job::snoozes`], the worker's [`crate::worker::Event`]s and its
    /// report), and past [`MAX_FREE_SNOOZES`](crate::jobs::MAX_FREE_SNOOZES) of them a snooze uses an attempt like a
    /// retry, so a job that always snoozes ends dead when its attempts run out, its error
    /// history saying so. `delay` is at most 366 days (a longer one is cut to that).
    pub fn snooze(delay: Duration) -> Self {
        JobError {
            message: format!("snoozed for {delay:?}"),
            action: Action::Snooze(delay.min(crate::MAX_TTL)),
        }
    }

    /// Parks the job: the run recorded a park ([`JobContext::park`]) and handed its token to
    /// whoever will answer it; the worker moves the job to `parked` (no claim, no attempt
    /// used up by waiting, no concurrency slot held) instead of retrying it. An answer that
    /// came while the handler was still running is applied then, once. Without a park of
    /// this run, the run is a failure (retried per policy), with an error that says so.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tenure::worker::{JobContext, JobError};
    ///
    /// fn charge(ctx: &JobContext, order: String) -> Result<(), JobError> {
    ///     let token = ctx.park(Duration::from_secs(3600))?;
    ///     // ... ask the payment provider to call back with token.expose_secret() ...
    ///     # let _ = (order, token);
    ///     Err(JobError::parked())
    /// }
    /// ```
    pub fn parked() -> Self {
        JobError {
            message: "parked".to_string(),
            action: Action::Park,
        }
    }

    /// The message kept with the job.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether this error makes the job dead now ([`JobError::dead`]).
    pub fn is_dead(&self) -> bool {
        self.action == Action::Dead
    }

    /// The delay of a [`JobError::snooze`].
    pub fn snoozed_for(&self) -> Option<Duration> {
        match self.action {
            Action::Snooze(delay) => Some(delay),
            _ => None,
        }
    }
}

/// Any error that boxes as `Box<dyn Error + Send + Sync>` is a retry per policy: this covers
/// `Send + Sync` error types, `String`, `&str`, the box itself and `anyhow::Error`.
impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> From<E> for JobError {
    fn from(error: E) -> Self {
        JobError::retry(error.into().to_string())
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobError({:?}, {:?})", self.action, self.message)
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// What a handler knows about the job it runs. Instants are the database's clock.
/// For a handler's unit tests, [`crate::testing::job_context`] makes one.
#[derive(Debug, Clone)]
pub struct JobContext {
    /// The job's id.
    pub id: i64,
    /// Its queue.
    pub queue: String,
    /// Its kind.
    pub kind: String,
    /// Which run this is (1 for the first).
    pub attempt: u32,
    /// How many runs it may have.
    pub max_attempts: u32,
    /// When the job was enqueued.
    pub enqueued_at: DateTime<Utc>,
    /// When this run became due (its first due time, or its retry's or snooze's).
    pub due_at: DateTime<Utc>,
    /// When this run was claimed: `claimed_at - due_at` is the time it waited in the queue.
    pub claimed_at: DateTime<Utc>,
    pub(crate) claim: JobClaim,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) notes: Arc<RunNotes>,
    pub(crate) pool: WorkerPool,
    /// The kind's retry policy: a park records it for a failure's retry.
    pub(crate) backoff: Backoff,
    /// Made for a test ([`crate::testing::context`]): its steps are kept in `notes`, not
    /// in the database, since no job row backs its claim.
    pub(crate) for_test: bool,
}

/// What a run leaves for the worker to write: its result (with its completion) and its
/// progress (by the heartbeat, at most once a second, only when changed).
#[derive(Debug, Default)]
pub(crate) struct RunNotes {
    /// Set once [`JobContext::park`] recorded a park for this run.
    pub parked: AtomicBool,
    pub result: Mutex<Option<JobResult>>,
    pub progress: Mutex<Option<(f64, String)>>,
    pub progress_changed: AtomicBool,
    /// A test context's completed steps, by name ([`JobContext::step`]).
    pub test_steps: Mutex<std::collections::HashMap<String, Vec<u8>>>,
}

impl RunNotes {
    /// The progress set since the last call, if it changed.
    pub fn take_progress(&self) -> Option<(f64, String)> {
        if !self.progress_changed.swap(false, Ordering::SeqCst) {
            return None;
        }
        self.progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn take_result(&self) -> Option<JobResult> {
        self.result
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// The worker's pool, for a handler's reads ([`JobContext::dependency_results`]); none in a
/// context made for a test.
#[derive(Clone, Default)]
pub(crate) struct WorkerPool(pub Option<Pool>);

impl fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "WorkerPool"
        } else {
            "None"
        })
    }
}

impl JobContext {
    /// True once the worker has given up on this run: its claim was lost (rescued, taken
    /// over or cancelled), it passed its timeout, or the worker is shutting down past its
    /// grace period. A long handler should check it and return.
    pub fn should_stop(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// The claim, to complete the job inside the handler's own transaction
    /// (`tenure::jobs::complete`): the handler's writes and the completion then commit together.
    /// The worker's own completion afterwards answers "already done".
    pub fn claim(&self) -> JobClaim {
        self.claim
    }

    /// How long this run waited between becoming due and being claimed.
    pub fn queue_wait(&self) -> Duration {
        (self.claimed_at - self.due_at).to_std().unwrap_or_default()
    }

    /// The result to keep with the job if this run completes it, for the jobs that depend
    /// on it to read ([`crate::jobs::dependency_results`]). Written in the completion's
    /// transaction; a later call replaces an earlier one; a run that fails keeps nothing.
    ///
    /// ```
    /// use tenure::jobs::JobResult;
    /// use tenure::worker::{JobContext, JobError};
    ///
    /// fn count_rows(ctx: &JobContext, table: String) -> Result<(), JobError> {
    ///     let rows = table.len(); // ... the real work ...
    ///     ctx.set_result(JobResult::json(&rows)?);
    ///     Ok(())
    /// }
    /// # count_rows(&tenure::testing::context("q", "k"), "t".into()).unwrap();
    /// ```
    pub fn set_result(&self, result: JobResult) {
        *self
            .notes
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(result);
    }

    /// Reports progress (a number, say a fraction done, and a short message) for others to
    /// read while the job runs ([`crate::jobs::get`]'s `progress`). Costs no write per call:
    /// the worker writes the latest value at most once a second, so a tight loop may call
    /// it every iteration.
    ///
    /// ```
    /// # let ctx = tenure::testing::context("q", "k");
    /// for i in 0..1000 {
    ///     ctx.set_progress(i as f64 / 1000.0, &format!("row {i}"));
    /// }
    /// ```
    pub fn set_progress(&self, value: f64, message: &str) {
        *self
            .notes
            .progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((value, message.to_string()));
        self.notes.progress_changed.store(true, Ordering::SeqCst);
    }

    /// Records a park for this run, fenced by its claim, and returns the token that answers
    /// it: hand it to the outside party (a webhook, an approver), then return
    /// [`JobError::parked`]. The job fails (retried per the kind's backoff while attempts
    /// remain, else dead) if no answer comes within `deadline` (database clock; at most 366
    /// days). The token works at once: an answer that comes before the handler returned is
    /// kept and applied when the job is parked. Once this returned a token the job waits for
    /// it: when the handler returns [`JobError::parked`] (past the shutdown's grace or the
    /// kind's timeout too), and when the worker dies before recording the park (the rescue
    /// parks it); if the handler returns anything else, its run's end wins and the token is
    /// refused after (see [`crate::jobs::ParkRefusal`]). Once per run: a second call is
    /// [`Error::InvalidInput`] and the first token stays the job's. [`Error::ClaimLost`] if
    /// the run's claim is gone, [`Error::InvalidInput`] for a job with a dedup key or in a
    /// context made for a test.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tenure::worker::{JobContext, JobError};
    ///
    /// fn approve(ctx: &JobContext, doc: String) -> Result<(), JobError> {
    ///     if let Some(answer) = ctx.resume_value()? {
    ///         println!("{doc}: {}", answer.decode::<String>()?);
    ///         return Ok(()); // resumed by the approver: go on
    ///     }
    ///     let token = ctx.park(Duration::from_secs(86_400))?;
    ///     println!("approve with {}", token.expose_secret());
    ///     Err(JobError::parked())
    /// }
    /// ```
    pub fn park(&self, deadline: Duration) -> Result<ParkToken> {
        let mut conn = self.connection()?;
        let token = crate::jobs::park_in_run(&mut conn, self.claim, deadline, self.backoff)?;
        self.notes.parked.store(true, Ordering::SeqCst);
        Ok(token)
    }

    /// The value given by the answer that resumed this job
    /// ([`crate::jobs::resume_parked`]), if its last park was resumed with one.
    /// [`Error::InvalidInput`] in a context made for a test.
    pub fn resume_value(&self) -> Result<Option<JobResult>> {
        let mut conn = self.connection()?;
        crate::jobs::resume_value(&mut conn, self.id)
    }

    fn connection(&self) -> Result<crate::PooledConnection> {
        let pool = self.pool.0.as_ref().ok_or_else(|| {
            Error::invalid("context", "has no worker pool (a context made for a test)")
        })?;
        pool.get()
    }

    /// The jobs this one depends on, with their states and results (a connection from the
    /// worker's pool, for one read). [`Error::InvalidInput`] in a context made for a test.
    pub fn dependency_results(&self) -> Result<Vec<DependencyResult>> {
        let pool = self.pool.0.as_ref().ok_or_else(|| {
            Error::invalid("context", "has no worker pool (a context made for a test)")
        })?;
        let mut conn = pool.get()?;
        crate::jobs::dependency_results(&mut conn, self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io() -> Result<(), JobError> {
        std::fs::read("/a/path/that/does/not/exist")?;
        Ok(())
    }
    fn text() -> Result<(), JobError> {
        Err(format!("a {}", "String"))?
    }
    fn str_slice() -> Result<(), JobError> {
        Err("a &str")?
    }
    fn boxed() -> Result<(), JobError> {
        let error: Box<dyn std::error::Error + Send + Sync> = "a box".into();
        Err(error)?
    }
    fn any() -> Result<(), JobError> {
        Err(anyhow::anyhow!("an anyhow"))?
    }
    fn tenure_error() -> Result<(), JobError> {
        Err(crate::Error::invalid("queue", "bad"))?
    }

    #[test]
    fn question_mark_makes_a_retry_from_any_error() {
        for (result, text) in [
            (io(), "No such file"),
            (text(), "a String"),
            (str_slice(), "a &str"),
            (boxed(), "a box"),
            (any(), "an anyhow"),
            (tenure_error(), "bad"),
        ] {
            let error = result.unwrap_err();
            assert_eq!(error.action, Action::Retry, "{error:?}");
            assert!(error.message().contains(text), "{error:?}");
        }
    }

    #[test]
    fn snooze_is_bounded_to_the_longest_delay_stored() {
        let error = JobError::snooze(Duration::from_secs(400 * 24 * 3600));
        assert_eq!(error.snoozed_for(), Some(crate::MAX_TTL));
        assert!(!error.is_dead());
        assert!(JobError::dead("x").is_dead());
    }
}

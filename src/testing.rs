//! Helpers for an application's own tests: unit-test a handler with a [`JobContext`] made
//! here, check what code under test enqueued ([`enqueued`], [`assert_enqueued`]), and run
//! queued jobs inline ([`drain`]). They work on every backend, SQLite in memory included.
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! use tenure::jobs::{self, JobArgs};
//! use tenure::testing;
//! use tenure::worker::{JobContext, JobError, Worker};
//!
//! #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
//! struct Welcome { to: String }
//! impl JobArgs for Welcome {
//!     const KIND: &'static str = "welcome";
//!     const QUEUE: &'static str = "mail";
//! }
//!
//! fn send_welcome(_ctx: &JobContext, job: Welcome) -> Result<(), JobError> {
//!     if job.to.is_empty() {
//!         return Err(JobError::dead("no recipient"));
//!     }
//!     Ok(())
//! }
//!
//! // A handler alone: no database.
//! assert!(send_welcome(&testing::job_context::<Welcome>(), Welcome { to: "".into() }).unwrap_err().is_dead());
//!
//! // What the code under test enqueued, then run it inline.
//! let pool = tenure::Pool::options().max_size(1).open(":memory:")?;
//! tenure::run_migrations(&mut pool.get()?)?;
//! jobs::enqueue_job(&mut pool.get()?, &Welcome { to: "ada@example.com".into() })?;
//! testing::assert_enqueued(&mut pool.get()?, &Welcome { to: "ada@example.com".into() });
//! let report = testing::drain(Worker::builder(pool.clone()).register(send_welcome))?;
//! assert_eq!(report.completed, 1);
//! assert!(testing::enqueued::<Welcome, _>(&mut pool.get()?)?.is_empty());
//! # Ok(()) }
//! ```

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use diesel::prelude::*;

use crate::backend::dispatch;
use crate::jobs::{JobArgs, JobClaim, JobState};
use crate::schema::tenure_jobs;
use crate::worker::{JobContext, Report, WorkerBuilder};
use crate::{Error, Result, TenureConnection};

/// A [`JobContext`] for calling a handler of `T` directly in a unit test: job id 0 on
/// `T::QUEUE`, kind `T::KIND`, first attempt of `T::MAX_ATTEMPTS`, all instants the host's
/// now, and a claim that no database knows (completing it answers `Lost`). Its fields are
/// public: change the attempt to test a last try.
pub fn job_context<T: JobArgs>() -> JobContext {
    let mut ctx = context(T::QUEUE, T::KIND);
    ctx.max_attempts = T::MAX_ATTEMPTS;
    ctx
}

/// A [`JobContext`] for a handler of a kind given by name: see [`job_context`].
pub fn context(queue: &str, kind: &str) -> JobContext {
    let now = chrono::Utc::now();
    JobContext {
        id: 0,
        queue: queue.to_string(),
        kind: kind.to_string(),
        attempt: 1,
        max_attempts: 25,
        enqueued_at: now,
        due_at: now,
        claimed_at: now,
        claim: JobClaim {
            id: 0,
            token: uuid::Uuid::new_v4(),
        },
        stop: Arc::new(AtomicBool::new(false)),
        notes: Default::default(),
        pool: Default::default(),
        backoff: Default::default(),
        for_test: true,
    }
}

/// `ctx` with a pool, so that the handler's [`JobContext::step`]s run in a unit test: each
/// runs its closure in a transaction on a connection of `pool` (its writes commit) and is
/// kept in the context, not the database (no job row backs a test context's claim): a
/// second call of the same step, on `ctx` or a clone of it, returns the kept value without
/// running the closure, as a retry would. [`JobContext::dependency_results`] reads `pool`
/// too.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tenure::worker::JobError;
/// let pool = tenure::Pool::options().max_size(1).open(":memory:")?;
/// let ctx = tenure::testing::with_pool(tenure::testing::context("q", "k"), &pool);
/// let mut runs = 0;
/// for _ in 0..2 {
///     let n: i32 = ctx.step("count", |_conn| { runs += 1; Ok::<_, JobError>(7) })
///         .map_err(|e| e.to_string())?;
///     assert_eq!(n, 7);
/// }
/// assert_eq!(runs, 1);
/// # Ok(()) }
/// ```
pub fn with_pool(mut ctx: JobContext, pool: &crate::Pool) -> JobContext {
    ctx.pool = crate::worker::WorkerPool(Some(pool.clone()));
    ctx
}

/// The result a handler set on `ctx` ([`JobContext::set_result`]), to test it.
pub fn result_of(ctx: &JobContext) -> Option<crate::jobs::JobResult> {
    ctx.notes
        .result
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// The progress a handler set on `ctx` ([`JobContext::set_progress`]), to test it.
pub fn progress_of(ctx: &JobContext) -> Option<(f64, String)> {
    ctx.notes
        .progress
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// Makes `ctx.should_stop()` true, as a worker does at a timeout, a cancel or a shutdown:
/// to test that a long handler returns when asked.
pub fn request_stop(ctx: &JobContext) {
    ctx.stop.store(true, Ordering::SeqCst);
}

/// The waiting jobs of type `T` (on `T::QUEUE`, of kind `T::KIND`), decoded, oldest first.
/// A payload that does not decode as `T` is an [`Error::InvalidInput`] naming the job.
pub fn enqueued<T: JobArgs, C: TenureConnection>(conn: &mut C) -> Result<Vec<T>> {
    let rows: Vec<(i64, Vec<u8>)> = dispatch!(conn, c => {
        tenure_jobs::table
            .filter(tenure_jobs::queue.eq(T::QUEUE))
            .filter(tenure_jobs::kind.eq(T::KIND))
            .filter(tenure_jobs::state.eq(JobState::Waiting))
            .order(tenure_jobs::id)
            .select((tenure_jobs::id, tenure_jobs::payload))
            .load(c)
    })?;
    rows.into_iter()
        .map(|(id, payload)| {
            serde_json::from_slice(&payload).map_err(|e| {
                Error::invalid(
                    "payload",
                    format!(
                        "job {id} of kind {:?} does not decode as {}: {e}",
                        T::KIND,
                        std::any::type_name::<T>()
                    ),
                )
            })
        })
        .collect()
}

/// Asserts that a job equal to `expected` is waiting (on `T::QUEUE`, of kind `T::KIND`).
/// A test assertion: it panics, listing what is waiting, when there is none, and when the
/// jobs cannot be read.
#[track_caller]
pub fn assert_enqueued<T: JobArgs + PartialEq + Debug, C: TenureConnection>(
    conn: &mut C,
    expected: &T,
) {
    match enqueued::<T, C>(conn) {
        Ok(waiting) if waiting.contains(expected) => {}
        Ok(waiting) => panic!(
            "no waiting {:?} job equal to {expected:?} on queue {:?}; waiting: {waiting:?}",
            T::KIND,
            T::QUEUE
        ),
        Err(e) => panic!("cannot read the waiting {:?} jobs: {e}", T::KIND),
    }
}

/// Runs every due job the worker has handlers for on the calling thread, one at a time,
/// until none is due (jobs that handlers enqueue included), and returns the report: the
/// same as [`WorkerBuilder::drain`].
pub fn drain(worker: WorkerBuilder) -> Result<Report> {
    worker.drain()
}

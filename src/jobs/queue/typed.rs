//! Typed jobs: a payload type declares its kind, queue and options once ([`JobArgs`]), and
//! is enqueued by value ([`enqueue_job`], [`enqueue_jobs`]) and run by a handler that gets
//! it decoded ([`crate::worker::WorkerBuilder::register`]).

use std::time::Duration;

use super::{Backoff, DedupOver, Enqueued, NewJob, OnDuplicate, enqueue, enqueue_many};
use crate::jobs::Limit;
use crate::{Result, TenureConnection};

/// A job's arguments as a Rust type: what it is (its kind), where it goes (its queue) and
/// how it runs (attempts, priority, retry policy, timeout, and a dedup key or concurrency
/// limit derived from the value). Stored as JSON.
///
/// Only [`KIND`](JobArgs::KIND) is required. The kind names the handler: keep it stable
/// across deploys (renaming the type is fine; renaming the kind strands waiting jobs).
///
/// ```
/// use std::time::Duration;
/// use tenure::jobs::JobArgs;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct SyncAccount { account: u64 }
///
/// impl JobArgs for SyncAccount {
///     const KIND: &'static str = "sync_account";
///     const QUEUE: &'static str = "sync";
///     const MAX_ATTEMPTS: u32 = 5;
///     const TIMEOUT: Option<Duration> = Some(Duration::from_secs(600));
///     // One sync per account at a time, across every worker.
///     fn limit(&self) -> Option<(String, u32)> {
///         Some((format!("account:{}", self.account), 1))
///     }
/// }
/// ```
pub trait JobArgs: serde::Serialize + serde::de::DeserializeOwned {
    /// The job's kind: which handler runs it (1 to [`crate::MAX_NAME_BYTES`] bytes).
    const KIND: &'static str;
    /// The queue its jobs go to (default `"default"`). A worker that registers this type
    /// serves this queue.
    const QUEUE: &'static str = "default";
    /// Runs a job may have before it is dead (default 25).
    const MAX_ATTEMPTS: u32 = 25;
    /// Lower runs first (default 0).
    const PRIORITY: i32 = 0;
    /// The retry policy of this kind (default `None`: the worker's).
    const BACKOFF: Option<Backoff> = None;
    /// How long a run may take before it is asked to stop and recorded as failed (default
    /// `None`: no timeout). See [`crate::worker::WorkerBuilder::timeout`].
    const TIMEOUT: Option<Duration> = None;
    /// A dedup window for values with a [`dedup_key`](JobArgs::dedup_key) (default `None`):
    /// see [`NewJob::dedup_window`]. Ignored for a value without a key.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tenure::jobs::{DedupOver, JobArgs, OnDuplicate};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Webhook { event: String }
    ///
    /// impl JobArgs for Webhook {
    ///     const KIND: &'static str = "webhook";
    ///     // A redelivery within a day of the first delivery's success is the same job.
    ///     const DEDUP_WINDOW: Option<(Duration, DedupOver)> =
    ///         Some((Duration::from_secs(86_400), DedupOver::Completed));
    ///     const ON_DUPLICATE: OnDuplicate = OnDuplicate::Keep;
    ///     fn dedup_key(&self) -> Option<String> {
    ///         Some(self.event.clone())
    ///     }
    /// }
    /// assert!(Webhook { event: "evt_1".into() }.to_job().is_ok());
    /// ```
    const DEDUP_WINDOW: Option<(Duration, DedupOver)> = None;
    /// What enqueueing a value with a [`dedup_key`](JobArgs::dedup_key) does to a live job
    /// with that key (default [`OnDuplicate::Keep`]): see [`NewJob::on_duplicate`]. Ignored
    /// for a value without a key.
    const ON_DUPLICATE: OnDuplicate = OnDuplicate::Keep;

    /// A deduplication key for this value (default none): see [`NewJob::dedup_key`].
    fn dedup_key(&self) -> Option<String> {
        None
    }

    /// A concurrency limit for this value, `(key, max)` (default none): see
    /// [`NewJob::limit`]. For rates or several keys, use [`limits`](Self::limits).
    fn limit(&self) -> Option<(String, u32)> {
        None
    }

    /// The limits of this value ([`Limit`]: concurrency and rate, per key; default: the
    /// one of [`limit`](Self::limit), if any). A job starts only when each has room.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tenure::jobs::{JobArgs, Limit};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Webhook { customer: u64 }
    /// impl JobArgs for Webhook {
    ///     const KIND: &'static str = "webhook";
    ///     fn limits(&self) -> Vec<Limit> {
    ///         vec![
    ///             Limit::rate(format!("customer:{}", self.customer), 10, Duration::from_secs(60)),
    ///             Limit::concurrency("webhooks", 20),
    ///         ]
    ///     }
    /// }
    /// let job = Webhook { customer: 7 }.to_job().unwrap();
    /// assert_eq!(job.limits().len(), 2);
    /// ```
    fn limits(&self) -> Vec<Limit> {
        self.limit()
            .map(|(key, max)| Limit::concurrency(key, max))
            .into_iter()
            .collect()
    }

    /// The job to enqueue for this value, with the type's options applied. Adjust it before
    /// enqueueing (a delay, a due time) with [`NewJob`]'s methods:
    /// `jobs::enqueue(conn, &value.to_job()?.delay(Duration::from_secs(60)))`.
    fn to_job(&self) -> Result<NewJob> {
        let mut job = NewJob::json(Self::QUEUE, Self::KIND, self)?
            .max_attempts(Self::MAX_ATTEMPTS)
            .priority(Self::PRIORITY);
        if let Some(key) = self.dedup_key() {
            job = job.dedup_key(key).on_duplicate(Self::ON_DUPLICATE);
            if let Some((window, over)) = Self::DEDUP_WINDOW {
                job = job.dedup_window(window, over);
            }
        }
        for limit in self.limits() {
            job = job.with_limit(limit);
        }
        Ok(job)
    }
}

/// Enqueues a typed job with its type's options: [`crate::jobs::enqueue`] of
/// [`JobArgs::to_job`]. Joins the caller's transaction, so the job exists only if it
/// commits.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, JobArgs};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Welcome { to: String }
/// impl JobArgs for Welcome {
///     const KIND: &'static str = "welcome";
///     const QUEUE: &'static str = "mail";
/// }
///
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let job = jobs::enqueue_job(&mut conn, &Welcome { to: "ada@example.com".into() })?;
/// assert_eq!(jobs::get(&mut conn, job.id)?.unwrap().queue, "mail");
/// # Ok(()) }
/// ```
pub fn enqueue_job<C: TenureConnection, T: JobArgs>(conn: &mut C, value: &T) -> Result<Enqueued> {
    enqueue(conn, &value.to_job()?)
}

/// Enqueues typed jobs of one type in one transaction ([`crate::jobs::enqueue_many`]): nothing is
/// written if any is invalid. One [`Enqueued`] per value, in order.
pub fn enqueue_jobs<C: TenureConnection, T: JobArgs>(
    conn: &mut C,
    values: &[T],
) -> Result<Vec<Enqueued>> {
    let jobs = values
        .iter()
        .map(JobArgs::to_job)
        .collect::<Result<Vec<_>>>()?;
    enqueue_many(conn, &jobs)
}

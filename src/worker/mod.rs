//! Workers on plain threads: claim jobs, run their handlers, heartbeat their claims, finish
//! them, and shut down gracefully.
//!
//! A worker holds three pooled connections (one claims, one records finished runs, one renews
//! claims), plus, outside the pool, one for maintenance (schedules, rescues, the ready ring's
//! rotation, retention: no claim waits behind them), on PostgreSQL and MySQL/MariaDB one
//! dedicated connection that holds its lock (see below) and on PostgreSQL one that LISTENs
//! for new jobs. Handler threads need none of their own, but handlers that use the pool need
//! one each: the builder refuses a pool smaller than `threads + 3`.
//!
//! Short jobs are claimed several at a time (up to [`WorkerBuilder::prefetch`], sized to about
//! 20 ms of work) and their completions recorded together, one transaction for many jobs,
//! each still fenced by its own claim token. A crash between a handler's return and the
//! recording leaves the job running under its claim: it is rescued, never lost.
//!
//! ## When a worker dies
//!
//! A worker registers when it starts (a row of [`tenure_workers`](crate::schema::tenure_workers))
//! and holds a lock for as long as its process lives: on PostgreSQL and MySQL/MariaDB a
//! session-level lock on its own connection, on SQLite an exclusive `flock` of the file
//! `<database>-workers/<id>` (every process of an SQLite file is on one host). Its claims
//! record it. When its process dies (a crash, SIGKILL, the OOM killer), the server ends its
//! session or the kernel closes its file, and the lock is free: the rescue of any other
//! worker (every half second, and as soon as a worker starts) takes its claims back, the
//! jobs it was running and those it had claimed ahead alike, as lapsed claims are (no
//! attempt used, a lapse counted): within about a second on SQLite and about five on a
//! server, whatever the claim ttl. A process that is only slow or stopped (a long pause,
//! SIGSTOP, a machine at load 10) keeps its lock and is never taken for dead; its claims
//! lapse only if it stops renewing them for the whole claim ttl, as before.
//!
//! On a server a session can end while its process lives (the server restarts, an operator
//! or a proxy kills the connection): the worker goes on writing its heartbeat (every second,
//! through its pooled connection) and takes its lock again on a new connection within about a
//! second. So a rescue takes a server worker for dead only once its lock is free, it has
//! written no heartbeat for 2 s, and rescues have found its lock free for 3 s (counted from
//! the first one that could see the server again after a restart). A worker whose row was
//! deleted while it lived (cut off from the database for those seconds) registers again; its
//! claims made meanwhile keep their ttl. The claim ttl stays the fallback for a host that
//! vanished without its session ending (a network partition: the server keeps the session
//! until its TCP keepalive gives up). A clean shutdown deletes the worker's row; runs still
//! in their handler past the grace period keep their claims under the ttl alone.
//!
//! A worker claims only jobs of kinds it has handlers for: jobs of other kinds wait for
//! their own workers, attempts untouched. Every recorded run is an [`Event`] (to hooks,
//! `tracing`, and metrics with the feature): see [`crate::events`].
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = dir.path().join("app.db").display().to_string();
//! use std::time::Duration;
//! use tenure::jobs::{self, JobArgs};
//! use tenure::worker::{JobContext, JobError, Worker};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Welcome { to: String }
//! impl JobArgs for Welcome {
//!     const KIND: &'static str = "welcome";
//!     const QUEUE: &'static str = "mail";
//! }
//!
//! let pool = tenure::Pool::open(&url)?;
//! tenure::run_migrations(&mut pool.get()?)?;
//! jobs::enqueue_job(&mut pool.get()?, &Welcome { to: "ada".into() })?;
//!
//! let worker = Worker::builder(pool.clone())
//!     .threads(2)
//!     .register(|_ctx: &JobContext, job: Welcome| {
//!         if job.to.is_empty() {
//!             return Err(JobError::dead("no recipient"));
//!         }
//!         Ok(()) // send it
//!     })
//!     .start()?;
//! # let until = std::time::Instant::now() + Duration::from_secs(30);
//! # while worker.report().completed < 1 && std::time::Instant::now() < until {
//! #     std::thread::sleep(Duration::from_millis(10));
//! # }
//! let report = worker.shutdown(Duration::from_secs(5));
//! # assert_eq!(report.completed, 1);
//! # Ok(()) }
//! ```

mod claimer;
mod connection;
mod finisher;
mod handle;
mod handlers;
mod heartbeat;
mod job;
mod listener;
mod liveness;
mod maintenance;
mod runs;
mod steps;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::events::Hook;
use crate::jobs::{Backoff, Finished, JobArgs, Retention};
use crate::{Error, Pool, Result, validate};

pub use crate::events::{Event, RunEvent, RunOutcome};
pub use handle::WorkerHandle;
pub(crate) use job::{Action, WorkerPool};
pub use job::{JobContext, JobError};
pub use runs::Report;

/// A claimed job on its way to a handler thread, with its run's stop flag.
struct Task {
    job: crate::jobs::ClaimedJob,
    stop: Arc<AtomicBool>,
    /// Where its handler leaves its result and progress (shared with its entry in the runs).
    notes: Arc<job::RunNotes>,
}

type Handler = dyn Fn(&JobContext, &[u8]) -> std::result::Result<(), HandlerFailure> + Send + Sync;

/// How a handler's run ended, other than success.
pub(crate) enum HandlerFailure {
    Job(JobError),
    /// The payload did not decode: dead at once, no retries.
    Undecodable(String),
}

/// Per kind: the handler, its retry policy (`None`: the worker's) and its timeout.
pub(crate) struct KindConfig {
    pub handler: Arc<Handler>,
    pub backoff: Option<Backoff>,
    pub timeout: Option<Duration>,
}

/// Builds a [`Worker`].
pub struct WorkerBuilder {
    pool: Pool,
    queues: Vec<String>,
    threads: usize,
    kinds: HashMap<String, KindConfig>,
    claim_ttl: Duration,
    poll_interval: Duration,
    backoff: Backoff,
    retention: Vec<(String, Finished, Retention)>,
    aging: Option<Duration>,
    run_schedules: bool,
    prefetch: usize,
    hooks: Vec<Hook>,
    drain_limit: usize,
    error: Option<Error>,
}

/// Starts workers: see [`Worker::builder`].
pub struct Worker;

impl Worker {
    /// A worker on `pool`'s database. Defaults: 4 threads, claim ttl 30 s (renewed every
    /// 10 s), poll interval 1 s, exponential backoff from 1 s to 1 h.
    pub fn builder(pool: Pool) -> WorkerBuilder {
        WorkerBuilder {
            pool,
            queues: Vec::new(),
            threads: 4,
            kinds: HashMap::new(),
            claim_ttl: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            backoff: Backoff::default(),
            retention: Vec::new(),
            aging: None,
            run_schedules: false,
            prefetch: 100,
            hooks: Vec::new(),
            drain_limit: 10_000,
            error: None,
        }
    }
}

impl WorkerBuilder {
    /// Serve this queue (call once per queue). [`WorkerBuilder::register`] adds its type's
    /// queue itself.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        let queue = queue.into();
        if !self.queues.contains(&queue) {
            self.queues.push(queue);
        }
        self
    }

    /// How many handlers run at once (default 4).
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }

    /// The most jobs claimed ahead of the threads (default 100; 0 claims only for idle
    /// threads). The worker holds fewer when jobs are slow: about 20 ms of work (by the
    /// moving average of run times), so short jobs are claimed and recorded several at a
    /// time while slow ones stay in the queue for other workers. Jobs claimed ahead are renewed like
    /// running ones and given back at shutdown without being started.
    pub fn prefetch(mut self, jobs: usize) -> Self {
        self.prefetch = jobs;
        self
    }

    /// How long a claim on a job lasts between heartbeats (default 30 s; heartbeats every
    /// third). A worker whose process dies is recognised sooner, by its lock (see "When a
    /// worker dies" in [`crate::worker`]); the ttl is for a worker that stops renewing its
    /// claims while its process lives (stopped, or cut off from the database), and for claims
    /// made outside a worker.
    pub fn claim_ttl(mut self, ttl: Duration) -> Self {
        self.claim_ttl = ttl;
        self
    }

    /// The longest pause between two claims while idle (default 1 s). Idle polling starts at
    /// 10 ms and doubles up to it; on PostgreSQL a NOTIFY from an enqueue wakes the worker at
    /// once.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The retry policy of kinds without their own (default: 1 s doubling to 1 h). Its
    /// `max` must be at most 366 days, the longest delay tenure stores.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.check_backoff(backoff);
        self.backoff = backoff;
        self
    }

    /// A policy whose delays no retry could be stored with is refused when the worker is
    /// built, not found out at the first failure.
    fn check_backoff(&mut self, backoff: Backoff) {
        if let Err(e) = validate::delay_micros(backoff.max) {
            self.error.get_or_insert(e);
        }
    }

    /// Runs jobs of type `T` ([`JobArgs`]) with `handler`, which gets the payload decoded:
    /// serves `T::QUEUE`, with `T::BACKOFF` and `T::TIMEOUT`. A payload that does not decode
    /// as `T` makes the job dead at once, without retries, its error naming the type.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("t.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// use tenure::jobs::{self, JobArgs};
    /// use tenure::worker::{JobContext, JobError, Worker};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Resize { image: String, width: u32 }
    /// impl JobArgs for Resize {
    ///     const KIND: &'static str = "resize";
    ///     const QUEUE: &'static str = "images";
    /// }
    ///
    /// jobs::enqueue_job(&mut pool.get()?, &Resize { image: "a.png".into(), width: 64 })?;
    /// let report = Worker::builder(pool)
    ///     .register(|_ctx: &JobContext, job: Resize| {
    ///         if job.width == 0 {
    ///             return Err(JobError::dead("width 0"));
    ///         }
    ///         Ok(())
    ///     })
    ///     .drain()?;
    /// assert_eq!(report.completed, 1);
    /// # Ok(()) }
    /// ```
    pub fn register<T, F>(self, handler: F) -> Self
    where
        T: JobArgs + 'static,
        F: Fn(&JobContext, T) -> std::result::Result<(), JobError> + Send + Sync + 'static,
    {
        let mut builder = self.queue(T::QUEUE).decoding(T::KIND.to_string(), handler);
        if let Some(config) = builder.kinds.get_mut(T::KIND) {
            config.backoff = T::BACKOFF;
            config.timeout = T::TIMEOUT;
        }
        if let Some(backoff) = T::BACKOFF {
            builder.check_backoff(backoff);
        }
        if T::TIMEOUT.is_some_and(|t| t.is_zero()) {
            builder
                .error
                .get_or_insert(Error::invalid("timeout", "must be longer than zero"));
        }
        builder
    }

    /// Runs jobs of `kind` with `handler`, their payload decoded from JSON into `T` (for
    /// kinds chosen at run time; [`WorkerBuilder::register`] ties a type to its kind). A
    /// payload that does not decode makes the job dead at once, without retries.
    pub fn handler<T, F>(self, kind: impl Into<String>, handler: F) -> Self
    where
        T: serde::de::DeserializeOwned,
        F: Fn(&JobContext, T) -> std::result::Result<(), JobError> + Send + Sync + 'static,
    {
        self.decoding(kind.into(), handler)
    }

    fn decoding<T, F>(self, kind: String, handler: F) -> Self
    where
        T: serde::de::DeserializeOwned,
        F: Fn(&JobContext, T) -> std::result::Result<(), JobError> + Send + Sync + 'static,
    {
        self.add(
            kind,
            Arc::new(move |ctx: &JobContext, payload: &[u8]| {
                let value: T = serde_json::from_slice(payload).map_err(|e| {
                    HandlerFailure::Undecodable(format!(
                        "the payload does not decode as {} (kind {:?}): {e}",
                        std::any::type_name::<T>(),
                        ctx.kind
                    ))
                })?;
                handler(ctx, value).map_err(HandlerFailure::Job)
            }),
        )
    }

    /// Runs jobs of `kind` with `handler`, given the payload's bytes.
    pub fn raw_handler<F>(self, kind: impl Into<String>, handler: F) -> Self
    where
        F: Fn(&JobContext, &[u8]) -> std::result::Result<(), JobError> + Send + Sync + 'static,
    {
        self.add(
            kind.into(),
            Arc::new(move |ctx: &JobContext, payload: &[u8]| {
                handler(ctx, payload).map_err(HandlerFailure::Job)
            }),
        )
    }

    fn add(mut self, kind: String, handler: Arc<Handler>) -> Self {
        if let Err(e) = validate::name("kind", &kind) {
            self.error.get_or_insert(e);
        }
        if self.kinds.contains_key(&kind) {
            self.error
                .get_or_insert(Error::invalid("kind", format!("{kind:?} has two handlers")));
        }
        self.kinds.insert(
            kind,
            KindConfig {
                handler,
                backoff: None,
                timeout: None,
            },
        );
        self
    }

    /// The retry policy of one kind (set after its handler).
    pub fn kind_backoff(mut self, kind: &str, backoff: Backoff) -> Self {
        self.check_backoff(backoff);
        match self.kinds.get_mut(kind) {
            Some(config) => config.backoff = Some(backoff),
            None => {
                self.error.get_or_insert(Error::invalid(
                    "kind",
                    format!("no handler for {kind:?} yet"),
                ));
            }
        }
        self
    }

    /// A timeout for one kind (set after its handler): at the timeout the worker raises
    /// [`JobContext::should_stop`]; when the handler returns, the run is recorded as failed
    /// (retried per policy), whatever it returned. A thread cannot be killed, so until then
    /// the job stays running under its claim (renewed): no retry of it starts meanwhile, and
    /// it keeps its concurrency-limit slot.
    pub fn timeout(mut self, kind: &str, timeout: Duration) -> Self {
        match self.kinds.get_mut(kind) {
            Some(config) if !timeout.is_zero() => config.timeout = Some(timeout),
            Some(_) => {
                self.error
                    .get_or_insert(Error::invalid("timeout", "must be longer than zero"));
            }
            None => {
                self.error.get_or_insert(Error::invalid(
                    "kind",
                    format!("no handler for {kind:?} yet"),
                ));
            }
        }
        self
    }

    /// Keeps finished jobs of `queue` per `policy`: the worker prunes them every few seconds
    /// ([`crate::jobs::prune`]), so `Retention::DeleteAll` deletes jobs soon after they finish.
    pub fn retention(
        mut self,
        queue: impl Into<String>,
        finished: Finished,
        policy: Retention,
    ) -> Self {
        self.retention.push((queue.into(), finished, policy));
        self
    }

    /// Ages its queues' waiting jobs ([`crate::jobs::age_priorities`]): one due for longer
    /// than `after` moves to the front, so more urgent jobs delay it by at most `after` plus a
    /// pass (`after` / 4, 250 ms to 30 s). `start` refuses `after` outside 1 ms to 366 days.
    /// ```
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("t.db").display().to_string()).unwrap();
    /// # tenure::run_migrations(&mut pool.get().unwrap()).unwrap();
    /// let worker = tenure::worker::Worker::builder(pool).queue("reports")
    ///     .raw_handler("report", |_: &tenure::worker::JobContext, _: &[u8]| Ok(()))
    ///     .age_priorities(std::time::Duration::from_secs(60)).start().unwrap();
    /// worker.shutdown(std::time::Duration::from_secs(5));
    /// ```
    pub fn age_priorities(mut self, after: Duration) -> Self {
        self.aging = Some(after);
        self
    }

    /// Also fire recurring schedules ([`crate::schedules::tick`]) from this worker, every
    /// 100 ms. Any number of workers may do so: each tick is enqueued once.
    pub fn run_schedules(mut self) -> Self {
        self.run_schedules = true;
        self
    }

    /// Calls `hook` with every [`Event`] of this worker (call again to add hooks): each run
    /// as recorded, each rescue, prune and schedules pass. Hooks run on the worker's own
    /// threads (the finisher's, the maintenance thread's): keep them quick. A worker without hooks
    /// builds no events for them.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("t.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use tenure::jobs::{self, NewJob};
    /// use tenure::worker::{Event, JobContext, RunOutcome, Worker};
    ///
    /// jobs::enqueue(&mut pool.get()?, &NewJob::new("q", "k", vec![]))?;
    /// let completed = Arc::new(AtomicUsize::new(0));
    /// let counter = completed.clone();
    /// Worker::builder(pool)
    ///     .queue("q")
    ///     .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
    ///     .on_event(move |event: &Event| {
    ///         if let Event::Run(run) = event {
    ///             if run.outcome == RunOutcome::Completed {
    ///                 counter.fetch_add(1, Ordering::Relaxed);
    ///             }
    ///         }
    ///     })
    ///     .drain()?;
    /// assert_eq!(completed.load(Ordering::Relaxed), 1);
    /// # Ok(()) }
    /// ```
    pub fn on_event(mut self, hook: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// Runs every due job of the worker's queues (of the kinds it has handlers for) on the
    /// calling thread, one at a time, until none is due, including jobs that handlers
    /// enqueue meanwhile; returns what happened. At most [`WorkerBuilder::drain_limit`] runs:
    /// past it, with jobs still due, [`Error::Timeout`]. For tests and one-shot passes: no threads,
    /// no heartbeats (claims last the claim ttl), and a pool of any size (the drain holds no
    /// connection while a handler runs). See also [`crate::testing`].
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("t.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// use tenure::jobs::{self, NewJob};
    /// use tenure::worker::{JobContext, Worker};
    /// jobs::enqueue(&mut pool.get()?, &NewJob::new("mail", "welcome", b"ada".to_vec()))?;
    /// let report = Worker::builder(pool)
    ///     .queue("mail")
    ///     .raw_handler("welcome", |_: &JobContext, to: &[u8]| { assert_eq!(to, b"ada"); Ok(()) })
    ///     .drain()?;
    /// assert_eq!(report.completed, 1);
    /// # Ok(()) }
    /// ```
    pub fn drain(self) -> Result<Report> {
        handle::drain(self.checked(1)?)
    }

    /// The most runs one [`WorkerBuilder::drain`] makes (default 10,000): a drain that
    /// reaches it with jobs still due gives the next one back and returns
    /// [`Error::Timeout`], instead of running forever when handlers keep enqueueing.
    pub fn drain_limit(mut self, runs: usize) -> Self {
        self.drain_limit = runs;
        self
    }

    /// Checks the configuration and starts the worker's threads.
    pub fn start(self) -> Result<WorkerHandle> {
        let needed = self.threads as u32 + 3;
        handle::start(self.checked(needed)?)
    }

    /// Checks the configuration; the pool must have `needed` connections.
    fn checked(self, needed: u32) -> Result<runs::Config> {
        if let Some(error) = self.error {
            return Err(error);
        }
        if self.queues.is_empty() {
            return Err(Error::invalid(
                "queues",
                "a worker needs at least one queue",
            ));
        }
        for queue in &self.queues {
            validate::name("queue", queue)?;
        }
        if self.kinds.is_empty() {
            return Err(Error::invalid(
                "handlers",
                "a worker needs at least one handler",
            ));
        }
        if self.kinds.len() > crate::jobs::MAX_KINDS {
            return Err(Error::invalid(
                "handlers",
                format!(
                    "{} kinds; a worker claims at most {} (one indexed read each per claim)",
                    self.kinds.len(),
                    crate::jobs::MAX_KINDS
                ),
            ));
        }
        if self.threads == 0 || self.threads > 1000 {
            return Err(Error::invalid(
                "threads",
                format!("{} is not between 1 and 1000", self.threads),
            ));
        }
        validate::ttl(self.claim_ttl)?;
        if self.claim_ttl < Duration::from_millis(30) {
            return Err(Error::invalid(
                "claim ttl",
                "heartbeats need at least 30 ms",
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::invalid("poll interval", "must be longer than zero"));
        }
        if self.pool.max_size() < needed {
            return Err(Error::invalid(
                "pool",
                format!(
                    "has {} connections; a worker with {} threads needs {needed} (threads + 3)",
                    self.pool.max_size(),
                    self.threads
                ),
            ));
        }
        for (queue, _, _) in &self.retention {
            validate::name("queue", queue)?;
        }
        if let Some(after) = self.aging {
            validate::aging_bound(after)?;
        }
        let mut kind_names: Vec<String> = self.kinds.keys().cloned().collect();
        kind_names.sort_unstable();
        let backoff = self.backoff;
        let kinds = self
            .kinds
            .into_iter()
            .map(|(kind, config)| {
                let config = runs::Kind {
                    handler: config.handler,
                    backoff: config.backoff.unwrap_or(backoff),
                    timeout: config.timeout,
                };
                (kind, config)
            })
            .collect();
        Ok(runs::Config {
            pool: self.pool,
            queues: self.queues,
            threads: self.threads,
            kinds,
            kind_names,
            claim_ttl: self.claim_ttl,
            poll_interval: self.poll_interval,
            retention: self.retention,
            aging: self.aging,
            run_schedules: self.run_schedules,
            prefetch: self.prefetch.min(crate::jobs::MAX_BATCH),
            hooks: self.hooks,
            drain_limit: self.drain_limit,
        })
    }
}

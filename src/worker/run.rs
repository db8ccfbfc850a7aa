//! The worker's threads: a claimer, handler threads, a heartbeat, and on PostgreSQL a
//! listener.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Action, HandlerFailure, JobContext, KindConfig};
use crate::jobs::{self, ClaimedJob, Finished, JobClaim, Outcome, Retention, Retry};
use crate::{Error, Pool, PooledConnection};

pub(crate) struct Config {
    pub pool: Pool,
    pub queues: Vec<String>,
    pub threads: usize,
    pub kinds: HashMap<String, KindConfig>,
    pub lease_ttl: Duration,
    pub poll_interval: Duration,
    pub retention: Vec<(String, Finished, Retention)>,
    pub run_schedules: bool,
}

/// What a worker did, from its start until [`WorkerHandle::shutdown`] returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Runs that completed their job.
    pub completed: usize,
    /// Runs that failed and left the job waiting for a retry.
    pub retried: usize,
    /// Runs after which the job is dead (failed for good, attempts used up, undecodable).
    pub dead: usize,
    /// Runs whose claim was lost before they finished (rescued or taken over).
    pub lost: usize,
    /// Runs whose job was cancelled while they ran.
    pub cancelled: usize,
    /// Runs that panicked (also counted as retried or dead).
    pub panicked: usize,
    /// Runs that passed their kind's timeout (also counted as retried or dead).
    pub timed_out: usize,
    /// Jobs given back at shutdown because they had not finished within the grace period.
    pub given_back: usize,
}

/// One running job, as the heartbeat and shutdown see it.
struct Running {
    claim: JobClaim,
    kind: String,
    stop: Arc<AtomicBool>,
    started: Instant,
    timeout: Option<Duration>,
}

struct State {
    busy: usize,
    running: HashMap<i64, Running>,
    stopping: bool,
    /// Set by the listener (or a freed slot) to cut the claimer's idle wait short.
    woken: bool,
    report: Report,
}

struct Shared {
    config: Config,
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(
        &'a self,
        state: MutexGuard<'a, State>,
        timeout: Duration,
    ) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(state, timeout)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn stopping(&self) -> bool {
        self.lock().stopping
    }

    fn count(&self, f: impl FnOnce(&mut Report)) {
        f(&mut self.lock().report);
    }
}

/// A running worker. [`WorkerHandle::shutdown`] stops it gracefully; dropping the handle
/// shuts it down with no grace period (unfinished jobs are given back at once).
pub struct WorkerHandle {
    shared: Arc<Shared>,
    claimer: Option<JoinHandle<()>>,
    heartbeat: Option<JoinHandle<()>>,
    listener: Option<JoinHandle<()>>,
    handlers: Vec<JoinHandle<()>>,
    done: bool,
}

struct Task {
    job: ClaimedJob,
    stop: Arc<AtomicBool>,
}

fn shared(config: Config) -> Arc<Shared> {
    Arc::new(Shared {
        config,
        state: Mutex::new(State {
            busy: 0,
            running: HashMap::new(),
            stopping: false,
            woken: false,
            report: Report::default(),
        }),
        changed: Condvar::new(),
    })
}

/// Runs due jobs on the calling thread until none is due (the test helper).
pub(crate) fn run_due(config: Config) -> crate::Result<Report> {
    let shared = shared(config);
    let mut conn = Connection::new(&shared.config.pool);
    loop {
        let mut ran = false;
        for queue in &shared.config.queues {
            let claimed = conn.with(|c| jobs::claim(c, queue, 1, shared.config.lease_ttl))?;
            for job in claimed {
                ran = true;
                let stop = Arc::new(AtomicBool::new(false));
                run_one(&shared, &mut conn, Task { job, stop });
            }
        }
        if !ran {
            return Ok(shared.lock().report.clone());
        }
    }
}

pub(crate) fn start(config: Config) -> crate::Result<WorkerHandle> {
    let threads = config.threads;
    let listen = config.pool.backend() == crate::Backend::Postgres;
    let shared = shared(config);
    let (tasks, inbox) = channel::<Task>();
    let inbox = Arc::new(Mutex::new(inbox));
    let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .map_err(|e| Error::invalid("threads", format!("cannot start a worker thread: {e}")))
    };
    let mut handlers = Vec::with_capacity(threads);
    for n in 0..threads {
        let (shared, inbox) = (shared.clone(), inbox.clone());
        handlers.push(spawn(
            format!("dibs-worker-{n}"),
            Box::new(move || run_handlers(&shared, &inbox)),
        )?);
    }
    let heartbeat = {
        let shared = shared.clone();
        spawn(
            "dibs-heartbeat".into(),
            Box::new(move || heartbeat(&shared)),
        )?
    };
    let listener = if listen {
        let shared = shared.clone();
        Some(spawn(
            "dibs-listener".into(),
            Box::new(move || listener::listen(&shared)),
        )?)
    } else {
        None
    };
    let claimer = {
        let shared = shared.clone();
        spawn(
            "dibs-claimer".into(),
            Box::new(move || claim_loop(&shared, tasks)),
        )?
    };
    Ok(WorkerHandle {
        shared,
        claimer: Some(claimer),
        heartbeat: Some(heartbeat),
        listener,
        handlers,
        done: false,
    })
}

impl WorkerHandle {
    /// What the worker has done so far.
    pub fn report(&self) -> Report {
        self.shared.lock().report.clone()
    }

    /// Stops claiming, waits up to `grace` for running jobs to finish, then gives back the
    /// ones that did not (due again at once, no attempt used, so another worker takes them
    /// straight away) and raises their [`JobContext::should_stop`]. Returns the report.
    pub fn shutdown(mut self, grace: Duration) -> Report {
        self.stop(grace)
    }

    fn stop(&mut self, grace: Duration) -> Report {
        if self.done {
            return self.report();
        }
        self.done = true;
        {
            let mut state = self.shared.lock();
            state.stopping = true;
        }
        self.shared.changed.notify_all();
        if let Some(claimer) = self.claimer.take() {
            let _ = claimer.join();
        }
        let until = Instant::now() + grace;
        let mut state = self.shared.lock();
        while state.busy > 0 && Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            state = self.shared.wait(state, left);
        }
        let unfinished: Vec<Running> = state.running.drain().map(|(_, r)| r).collect();
        drop(state);
        // The heartbeat exits once nothing runs.
        self.shared.changed.notify_all();
        if !unfinished.is_empty() {
            for running in &unfinished {
                running.stop.store(true, Ordering::SeqCst);
            }
            let claims: Vec<JobClaim> = unfinished.iter().map(|r| r.claim).collect();
            let given_back = self
                .shared
                .config
                .pool
                .get()
                .and_then(|mut conn| jobs::give_back(&mut conn, &claims));
            match given_back {
                Ok(outcomes) => {
                    let n = outcomes.iter().filter(|o| **o == Outcome::Done).count();
                    self.shared.count(|r| r.given_back += n);
                    tracing::info!(jobs = n, "shutdown: gave back unfinished jobs");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "shutdown: giving back unfinished jobs failed; their claims will lapse")
                }
            }
        }
        for thread in [self.heartbeat.take(), self.listener.take()]
            .into_iter()
            .flatten()
        {
            let _ = thread.join();
        }
        // Handler threads still inside a handler finish it on their own; the others exit now.
        for thread in self.handlers.drain(..) {
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
        self.report()
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

/// A pooled connection that is replaced after an error.
struct Connection<'a> {
    pool: &'a Pool,
    conn: Option<PooledConnection>,
}

impl<'a> Connection<'a> {
    fn new(pool: &'a Pool) -> Self {
        Connection { pool, conn: None }
    }

    fn with<T>(
        &mut self,
        f: impl FnOnce(&mut PooledConnection) -> crate::Result<T>,
    ) -> crate::Result<T> {
        let conn = match self.conn.as_mut() {
            Some(conn) => conn,
            None => self.conn.insert(self.pool.get()?),
        };
        let outcome = f(conn);
        if outcome.is_err() {
            // It may be broken (the database restarted): take a fresh one next time.
            self.conn = None;
        }
        outcome
    }
}

/// Claims as many jobs as there are free threads, hands them out, rescues stalled jobs, and
/// backs off while idle.
fn claim_loop(shared: &Shared, tasks: Sender<Task>) {
    let config = &shared.config;
    let mut conn = Connection::new(&config.pool);
    let mut idle = Duration::from_millis(10);
    let mut error_pause = Duration::from_millis(100);
    let rescue_every = (config.lease_ttl / 2).min(Duration::from_secs(30));
    let mut next_rescue = Instant::now();
    let mut next_prune = Instant::now();
    let mut next_schedules = Instant::now();
    // With schedules to fire, idle waits stay short enough to fire them on time.
    let max_idle = if config.run_schedules {
        config.poll_interval.min(SCHEDULES_EVERY)
    } else {
        config.poll_interval
    };
    let mut next_queue = 0;
    loop {
        let free = {
            let mut state = shared.lock();
            loop {
                if state.stopping {
                    return;
                }
                if state.busy < config.threads {
                    break;
                }
                state = shared.wait(state, config.poll_interval);
            }
            config.threads - state.busy
        };
        if config.run_schedules && Instant::now() >= next_schedules {
            next_schedules = Instant::now() + SCHEDULES_EVERY;
            if let Err(e) = conn.with(crate::schedules::tick) {
                tracing::warn!(error = %e, "firing schedules failed");
            }
        }
        if !config.retention.is_empty() && Instant::now() >= next_prune {
            next_prune = Instant::now() + PRUNE_EVERY;
            prune_all(&mut conn, &config.retention);
        }
        if Instant::now() >= next_rescue {
            next_rescue = Instant::now() + rescue_every;
            match conn.with(|c| jobs::rescue(c, 100)) {
                Ok(rescued) if !(rescued.requeued.is_empty() && rescued.dead.is_empty()) => {
                    tracing::info!(
                        requeued = rescued.requeued.len(),
                        dead = rescued.dead.len(),
                        "rescued stalled jobs"
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "rescue failed"),
            }
        }
        let Some(queue) = config.queues.get(next_queue % config.queues.len().max(1)) else {
            return;
        };
        next_queue += 1;
        match conn.with(|c| jobs::claim(c, queue, free, config.lease_ttl)) {
            Ok(claimed) if !claimed.is_empty() => {
                idle = Duration::from_millis(10);
                error_pause = Duration::from_millis(100);
                let mut state = shared.lock();
                for job in claimed {
                    let stop = Arc::new(AtomicBool::new(false));
                    let timeout = config.kinds.get(&job.kind).and_then(|k| k.timeout);
                    state.busy += 1;
                    state.running.insert(
                        job.id,
                        Running {
                            claim: job.claim(),
                            kind: job.kind.clone(),
                            stop: stop.clone(),
                            started: Instant::now(),
                            timeout,
                        },
                    );
                    if tasks.send(Task { job, stop }).is_err() {
                        return;
                    }
                }
            }
            Ok(_) => {
                // Nothing due in this queue; after a full round of queues, wait.
                if next_queue % config.queues.len().max(1) == 0 {
                    let mut state = shared.lock();
                    if !state.woken && !state.stopping {
                        state = shared.wait(state, idle);
                    }
                    let woken = std::mem::take(&mut state.woken);
                    drop(state);
                    idle = if woken {
                        Duration::from_millis(10)
                    } else {
                        (idle * 2).min(max_idle)
                    };
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, pause = ?error_pause, "claiming failed; backing off");
                let state = shared.lock();
                drop(shared.wait(state, error_pause));
                error_pause = (error_pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// How often a worker that runs schedules fires them.
const SCHEDULES_EVERY: Duration = Duration::from_millis(100);

/// How often a worker with retention policies prunes.
const PRUNE_EVERY: Duration = Duration::from_secs(5);

/// One pruning pass: every policy, in batches, until a batch comes back short.
fn prune_all(conn: &mut Connection<'_>, policies: &[(String, Finished, Retention)]) {
    for (queue, finished, policy) in policies {
        loop {
            match conn.with(|c| jobs::prune(c, queue, *finished, *policy, jobs::MAX_BATCH)) {
                Ok(n) if n == jobs::MAX_BATCH => continue,
                Ok(n) => {
                    if n > 0 {
                        tracing::debug!(%queue, deleted = n, "pruned finished jobs");
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(%queue, error = %e, "pruning failed");
                    break;
                }
            }
        }
    }
}

/// A handler thread: runs tasks until the claimer closes the channel.
fn run_handlers(shared: &Shared, inbox: &Mutex<Receiver<Task>>) {
    let mut conn = Connection::new(&shared.config.pool);
    loop {
        let task = {
            let inbox = inbox.lock().unwrap_or_else(PoisonError::into_inner);
            inbox.recv()
        };
        let Ok(task) = task else { return };
        let id = task.job.id;
        run_one(shared, &mut conn, task);
        let mut state = shared.lock();
        state.running.remove(&id);
        state.busy = state.busy.saturating_sub(1);
        state.woken = true;
        drop(state);
        shared.changed.notify_all();
    }
}

fn run_one(shared: &Shared, conn: &mut Connection<'_>, task: Task) {
    let Task { job, stop } = task;
    let span = tracing::info_span!("dibs.job", job.id = job.id, queue = %job.queue, kind = %job.kind, attempt = job.attempt);
    let _entered = span.enter();
    let started = Instant::now();
    let ctx = JobContext {
        id: job.id,
        queue: job.queue.clone(),
        kind: job.kind.clone(),
        attempt: job.attempt,
        max_attempts: job.max_attempts,
        claim: job.claim(),
        stop: stop.clone(),
    };
    let config = shared.config.kinds.get(&job.kind);
    let backoff = config.map(|k| k.backoff).unwrap_or_default();
    let outcome = match config {
        None => Err(HandlerFailure::Job(super::JobError::retry(format!(
            "no handler for kind {:?} on this worker",
            job.kind
        )))),
        Some(kind) => match catch_unwind(AssertUnwindSafe(|| (kind.handler)(&ctx, &job.payload))) {
            Ok(outcome) => outcome,
            Err(panic) => {
                shared.count(|r| r.panicked += 1);
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_string());
                Err(HandlerFailure::Job(super::JobError::retry(format!(
                    "the handler panicked: {message}"
                ))))
            }
        },
    };
    let finished = match &outcome {
        Ok(()) => conn
            .with(|c| jobs::complete(c, &[job.claim()]))
            .map(|o| (o.first().copied().unwrap_or(Outcome::Lost), "completed")),
        Err(failure) => {
            let (message, retry) = match failure {
                HandlerFailure::Undecodable(message) => (message.as_str(), Retry::Never),
                HandlerFailure::Job(error) => (
                    error.message.as_str(),
                    match error.action {
                        Action::Retry => Retry::Backoff(backoff),
                        Action::RetryAt(at) => Retry::At(at),
                        Action::Fail => Retry::Never,
                    },
                ),
            };
            let exhausted = job.attempt >= job.max_attempts || retry == Retry::Never;
            conn.with(|c| jobs::fail(c, job.claim(), message, retry))
                .map(|o| (o, if exhausted { "dead" } else { "retried" }))
        }
    };
    let took = started.elapsed();
    match finished {
        Ok((Outcome::Done, what)) | Ok((Outcome::AlreadyDone, what)) => {
            shared.count(|r| match what {
                "completed" => r.completed += 1,
                "dead" => r.dead += 1,
                _ => r.retried += 1,
            });
            tracing::info!(outcome = what, ?took, "job finished");
        }
        Ok((Outcome::Lost, _)) => {
            shared.count(|r| r.lost += 1);
            tracing::warn!(?took, "job's claim was lost before it finished");
        }
        Ok((Outcome::Cancelled, _)) => {
            shared.count(|r| r.cancelled += 1);
            tracing::info!(?took, "job was cancelled while it ran");
        }
        Err(e) => {
            // The claim stays; the heartbeat stops renewing it once it leaves the registry,
            // so it lapses and is rescued: never lost.
            tracing::warn!(error = %e, ?took, "finishing a job failed; it will be rescued");
        }
    }
}

/// Renews every running claim every ttl/3 on a connection of its own, fails runs past their
/// timeout, and raises the stop flag of runs whose claim was lost.
fn heartbeat(shared: &Shared) {
    let config = &shared.config;
    let mut conn = Connection::new(&config.pool);
    let period = config.lease_ttl / 3;
    let mut next_beat = Instant::now() + period;
    loop {
        // Sleep until the next beat or the earliest timeout, whichever comes first; other
        // wake-ups (a job finished) do not make beats more frequent.
        let beat = {
            let mut state = shared.lock();
            loop {
                if state.stopping && state.running.is_empty() {
                    return;
                }
                let now = Instant::now();
                let next_timeout = state
                    .running
                    .values()
                    .filter_map(|r| r.timeout.map(|t| r.started + t))
                    .min();
                if now >= next_beat || next_timeout.is_some_and(|t| now >= t) {
                    break now >= next_beat;
                }
                let until = next_timeout.map_or(next_beat, |t| t.min(next_beat));
                state = shared.wait(state, until - now);
            }
        };
        // Runs past their timeout: stop renewing, raise the flag, fail the run.
        let now = Instant::now();
        let timed_out: Vec<(JobClaim, String, Duration)> = {
            let mut state = shared.lock();
            let expired: Vec<i64> = state
                .running
                .values()
                .filter(|r| {
                    r.timeout
                        .is_some_and(|t| now.duration_since(r.started) >= t)
                })
                .map(|r| r.claim.id)
                .collect();
            expired
                .into_iter()
                .filter_map(|id| state.running.remove(&id))
                .map(|r| {
                    r.stop.store(true, Ordering::SeqCst);
                    (r.claim, r.kind, r.timeout.unwrap_or_default())
                })
                .collect()
        };
        for (claim, kind, timeout) in timed_out {
            let backoff = config
                .kinds
                .get(&kind)
                .map(|k| k.backoff)
                .unwrap_or_default();
            let message = format!("timed out after {timeout:?}");
            match conn.with(|c| jobs::fail(c, claim, &message, Retry::Backoff(backoff))) {
                Ok(_) => shared.count(|r| r.timed_out += 1),
                Err(e) => {
                    tracing::warn!(job.id = claim.id, error = %e, "failing a timed-out job failed; it will be rescued")
                }
            }
        }
        if !beat {
            continue;
        }
        next_beat = Instant::now() + period;
        let claims: Vec<JobClaim> = shared.lock().running.values().map(|r| r.claim).collect();
        for batch in claims.chunks(jobs::MAX_BATCH) {
            match conn.with(|c| jobs::renew(c, batch, config.lease_ttl)) {
                Ok(outcomes) => {
                    let state = shared.lock();
                    for (claim, outcome) in batch.iter().zip(outcomes) {
                        if matches!(outcome, Outcome::Lost | Outcome::Cancelled)
                            && let Some(running) = state.running.get(&claim.id)
                        {
                            running.stop.store(true, Ordering::SeqCst);
                            tracing::warn!(
                                job.id = claim.id,
                                ?outcome,
                                "heartbeat: the claim ended"
                            );
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "heartbeat failed; retrying at the next beat"),
            }
        }
    }
}

mod listener {
    use super::Shared;

    /// Without PostgreSQL there is nothing to listen to.
    #[cfg(not(feature = "postgres"))]
    pub(super) fn listen(_shared: &Shared) {}

    /// LISTENs on a dedicated connection and wakes the claimer when a job is enqueued on one
    /// of its queues. The notification iterator does not block, so this polls it every
    /// 20 ms; reconnects with backoff when the connection breaks (polling keeps working).
    #[cfg(feature = "postgres")]
    pub(super) fn listen(shared: &Shared) {
        use std::time::Duration;

        use crate::backend::postgres::{listen, notified_queues};
        use crate::{BackendConnection, DibsConnection};

        let mut pause = Duration::from_millis(100);
        while !shared.stopping() {
            let mut conn = match shared.config.pool.dedicated_connection() {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "listener: cannot connect; polling only");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            // Irrefutable when PostgreSQL is the only backend compiled in.
            #[allow(irrefutable_let_patterns)]
            let BackendConnection::Postgres(pg) = conn.backend_connection() else {
                return;
            };
            if let Err(e) = listen(pg) {
                tracing::warn!(error = %e, "listener: LISTEN failed");
                std::thread::sleep(pause);
                continue;
            }
            pause = Duration::from_millis(100);
            while !shared.stopping() {
                match notified_queues(pg) {
                    Ok(queues) => {
                        if queues.iter().any(|q| shared.config.queues.contains(q)) {
                            shared.lock().woken = true;
                            shared.changed.notify_all();
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "listener: connection lost; reconnecting");
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

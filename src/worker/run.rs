//! The worker's threads: a claimer, handler threads, a heartbeat, and on PostgreSQL a
//! listener.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
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
    /// The most jobs claimed ahead of the threads.
    pub prefetch: usize,
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

/// Where a claimed job is in this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Claimed, waiting for a handler thread (prefetched).
    Queued,
    /// A handler runs it.
    Active,
    /// Its handler returned; the finisher has not yet recorded the outcome.
    Finishing,
}

/// One claimed job, as the heartbeat and shutdown see it.
struct Running {
    claim: JobClaim,
    kind: String,
    stop: Arc<AtomicBool>,
    phase: Phase,
    started: Option<Instant>,
    timeout: Option<Duration>,
}

/// How a handler's run is to be recorded (by the finisher).
enum Settle {
    Complete(JobClaim),
    Fail {
        claim: JobClaim,
        message: String,
        retry: Retry,
        exhausted: bool,
    },
}

impl Settle {
    fn claim(&self) -> JobClaim {
        match self {
            Settle::Complete(claim) | Settle::Fail { claim, .. } => *claim,
        }
    }
}

struct State {
    /// Every job this worker holds a claim on, whatever its phase; the heartbeat renews them
    /// all.
    held: HashMap<i64, Running>,
    queued: usize,
    active: usize,
    /// Runs waiting for the finisher, and how many it is recording right now.
    settle: Vec<Settle>,
    settling: usize,
    /// The claimer stops; queued jobs are no longer started.
    stopping: bool,
    /// Past the grace period: the finisher records what is left and exits, the heartbeat
    /// exits.
    closing: bool,
    /// Set by the listener, a local enqueue or a freed thread to cut the claimer's idle wait
    /// short.
    woken: bool,
    /// Moving average of a handler's run time, in seconds: it sizes the prefetch.
    average_run: Option<f64>,
    report: Report,
}

impl State {
    /// How many jobs to hold beyond one per thread: about [`PREFETCH_HORIZON`] of work, at
    /// most `max` (none until a run was timed, and none for slow jobs, which other workers
    /// should be free to take).
    fn prefetch(&self, threads: usize, max: usize) -> usize {
        match self.average_run {
            Some(average) if average > 0.0 => {
                let jobs = threads as f64 * PREFETCH_HORIZON.as_secs_f64() / average;
                (jobs as usize).min(max)
            }
            Some(_) => max,
            None => 0,
        }
    }
}

/// How much work, in handler time, a worker claims ahead of its threads.
const PREFETCH_HORIZON: Duration = Duration::from_millis(20);

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

    /// Wakes the claimer if it serves `queue`.
    fn wake(&self, queue: &str) {
        if self.config.queues.iter().any(|q| q == queue) {
            self.lock().woken = true;
            self.changed.notify_all();
        }
    }
}

/// The running workers of this process, so an enqueue here wakes them at once (on every
/// backend; PostgreSQL's NOTIFY also reaches other processes).
static LOCAL_WORKERS: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

/// Wakes this process's idle workers of `queues` (called after an enqueue). A wake-up for
/// a job not committed yet only costs the worker an empty claim.
pub(crate) fn wake_local<'q>(queues: impl IntoIterator<Item = &'q str>) {
    let workers: Vec<Arc<Shared>> = {
        let mut registry = LOCAL_WORKERS.lock().unwrap_or_else(PoisonError::into_inner);
        registry.retain(|w| w.strong_count() > 0);
        registry.iter().filter_map(Weak::upgrade).collect()
    };
    if workers.is_empty() {
        return;
    }
    let queues: Vec<&str> = queues.into_iter().collect();
    for worker in workers {
        for queue in &queues {
            worker.wake(queue);
        }
    }
}

/// A running worker. [`WorkerHandle::shutdown`] stops it gracefully; dropping the handle
/// shuts it down with no grace period (unfinished jobs are given back at once).
pub struct WorkerHandle {
    shared: Arc<Shared>,
    claimer: Option<JoinHandle<()>>,
    finisher: Option<JoinHandle<()>>,
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
            held: HashMap::new(),
            queued: 0,
            active: 0,
            settle: Vec::new(),
            settling: 0,
            stopping: false,
            closing: false,
            woken: false,
            average_run: None,
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
                let settle = run_one(&shared, Task { job, stop });
                if let Err(e) = record(&shared, &mut conn, &[settle]) {
                    tracing::warn!(error = %e, "finishing a job failed; it will be rescued");
                }
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
    let finisher = {
        let shared = shared.clone();
        spawn("dibs-finisher".into(), Box::new(move || finisher(&shared)))?
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
    LOCAL_WORKERS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(Arc::downgrade(&shared));
    Ok(WorkerHandle {
        shared,
        claimer: Some(claimer),
        finisher: Some(finisher),
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
    /// straight away) and raises their [`JobContext::should_stop`]. Jobs claimed ahead that
    /// no thread had started are given back at once. Returns the report.
    pub fn shutdown(mut self, grace: Duration) -> Report {
        self.stop(grace)
    }

    fn stop(&mut self, grace: Duration) -> Report {
        if self.done {
            return self.report();
        }
        self.done = true;
        self.shared.lock().stopping = true;
        self.shared.changed.notify_all();
        if let Some(claimer) = self.claimer.take() {
            let _ = claimer.join();
        }
        let until = Instant::now() + grace;
        let mut state = self.shared.lock();
        while (state.active > 0 || !state.settle.is_empty() || state.settling > 0)
            && Instant::now() < until
        {
            let left = until.saturating_duration_since(Instant::now());
            state = self.shared.wait(state, left);
        }
        // Everything not finishing: queued (never started) and runs past the grace period.
        let unfinished: Vec<i64> = state
            .held
            .iter()
            .filter(|(_, r)| r.phase != Phase::Finishing)
            .map(|(id, _)| *id)
            .collect();
        let unfinished: Vec<Running> = unfinished
            .into_iter()
            .filter_map(|id| state.held.remove(&id))
            .collect();
        state.closing = true;
        drop(state);
        self.shared.changed.notify_all();
        if !unfinished.is_empty() {
            for running in &unfinished {
                running.stop.store(true, Ordering::SeqCst);
            }
            let claims: Vec<JobClaim> = unfinished.iter().map(|r| r.claim).collect();
            let given_back = self.shared.config.pool.get().and_then(|mut conn| {
                let mut outcomes = Vec::with_capacity(claims.len());
                for batch in claims.chunks(jobs::MAX_BATCH) {
                    outcomes.extend(jobs::give_back(&mut conn, batch)?);
                }
                Ok(outcomes)
            });
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
        for thread in [
            self.finisher.take(),
            self.heartbeat.take(),
            self.listener.take(),
        ]
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

/// Claims jobs for the free threads plus a prefetch sized by how fast jobs run, hands them
/// out, rescues stalled jobs, and backs off while idle.
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
        let wanted = {
            let mut state = shared.lock();
            loop {
                if state.stopping {
                    return;
                }
                let prefetch = state.prefetch(config.threads, config.prefetch);
                let in_hand = state.active + state.queued;
                let wanted = (config.threads + prefetch).saturating_sub(in_hand);
                // Claim again once the prefetched jobs run low (not for every freed
                // thread: fewer, bigger claims), and not while the finisher is far behind.
                let low = state.queued <= prefetch / 2;
                let backlog = state.settle.len() + state.settling;
                if wanted > 0 && low && backlog < jobs::MAX_BATCH {
                    break wanted.min(jobs::MAX_BATCH);
                }
                state = shared.wait(state, config.poll_interval);
            }
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
        match conn.with(|c| jobs::claim(c, queue, wanted, config.lease_ttl)) {
            Ok(claimed) if !claimed.is_empty() => {
                idle = Duration::from_millis(10);
                error_pause = Duration::from_millis(100);
                let mut state = shared.lock();
                for job in claimed {
                    let stop = Arc::new(AtomicBool::new(false));
                    let timeout = config.kinds.get(&job.kind).and_then(|k| k.timeout);
                    state.queued += 1;
                    state.held.insert(
                        job.id,
                        Running {
                            claim: job.claim(),
                            kind: job.kind.clone(),
                            stop: stop.clone(),
                            phase: Phase::Queued,
                            started: None,
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

/// A handler thread: runs tasks until the claimer closes the channel. It needs no
/// connection: the finisher records every run.
fn run_handlers(shared: &Shared, inbox: &Mutex<Receiver<Task>>) {
    loop {
        let task = {
            let inbox = inbox.lock().unwrap_or_else(PoisonError::into_inner);
            inbox.recv()
        };
        let Ok(task) = task else { return };
        let id = task.job.id;
        {
            let mut state = shared.lock();
            state.queued = state.queued.saturating_sub(1);
            if state.stopping {
                // Shutting down: a job claimed ahead is given back, not started.
                drop(state);
                shared.changed.notify_all();
                continue;
            }
            match state.held.get_mut(&id) {
                Some(running) => {
                    running.phase = Phase::Active;
                    running.started = Some(Instant::now());
                }
                // The heartbeat learned the claim was lost before it started.
                None => continue,
            }
            state.active += 1;
        }
        shared.changed.notify_all();
        let started = Instant::now();
        let settle = run_one(shared, task);
        let took = started.elapsed().as_secs_f64();
        let mut state = shared.lock();
        state.active = state.active.saturating_sub(1);
        state.average_run = Some(match state.average_run {
            Some(average) => average * 0.9 + took * 0.1,
            None => took,
        });
        // A run that timed out or was given back at shutdown is no longer held: its end
        // was recorded already.
        if let Some(running) = state.held.get_mut(&id) {
            running.phase = Phase::Finishing;
            state.settle.push(settle);
        }
        state.woken = true;
        drop(state);
        shared.changed.notify_all();
    }
}

/// Runs one job's handler (catching a panic) and says how to record the run.
fn run_one(shared: &Shared, task: Task) -> Settle {
    let Task { job, stop } = task;
    let span = tracing::info_span!("dibs.job", job.id = job.id, queue = %job.queue, kind = %job.kind, attempt = job.attempt);
    let _entered = span.enter();
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
    match outcome {
        Ok(()) => Settle::Complete(job.claim()),
        Err(failure) => {
            let (message, retry) = match failure {
                HandlerFailure::Undecodable(message) => (message, Retry::Never),
                HandlerFailure::Job(error) => {
                    let retry = match error.action {
                        Action::Retry => Retry::Backoff(backoff),
                        Action::RetryAt(at) => Retry::At(at),
                        Action::Fail => Retry::Never,
                    };
                    (error.message, retry)
                }
            };
            Settle::Fail {
                claim: job.claim(),
                exhausted: job.attempt >= job.max_attempts || retry == Retry::Never,
                message,
                retry,
            }
        }
    }
}

/// Records runs: completions together in one transaction (each still fenced by its claim
/// token), failures one by one; counts the outcomes.
fn record(shared: &Shared, conn: &mut Connection<'_>, runs: &[Settle]) -> crate::Result<()> {
    let completions: Vec<JobClaim> = runs
        .iter()
        .filter_map(|s| match s {
            Settle::Complete(claim) => Some(*claim),
            Settle::Fail { .. } => None,
        })
        .collect();
    let mut outcomes: Vec<(Outcome, &'static str)> = Vec::with_capacity(runs.len());
    if !completions.is_empty() {
        let done = conn.with(|c| jobs::complete(c, &completions))?;
        outcomes.extend(done.into_iter().map(|o| (o, "completed")));
    }
    for run in runs {
        if let Settle::Fail {
            claim,
            message,
            retry,
            exhausted,
        } = run
        {
            let outcome = conn.with(|c| jobs::fail(c, *claim, message, *retry))?;
            outcomes.push((outcome, if *exhausted { "dead" } else { "retried" }));
        }
    }
    let mut state = shared.lock();
    for (outcome, what) in outcomes {
        match outcome {
            Outcome::Done | Outcome::AlreadyDone => match what {
                "completed" => state.report.completed += 1,
                "dead" => state.report.dead += 1,
                _ => state.report.retried += 1,
            },
            Outcome::Lost => {
                state.report.lost += 1;
                tracing::warn!("a job's claim was lost before it finished");
            }
            Outcome::Cancelled => {
                state.report.cancelled += 1;
                tracing::info!("a job was cancelled while it ran");
            }
        }
    }
    Ok(())
}

/// Records finished runs as they come, in batches: while one batch is written the next
/// gathers, so a busy worker commits once for many jobs and an idle one adds no delay. A
/// batch that cannot be written stays held (the heartbeat keeps renewing its claims) and is
/// tried again after a pause; a crash before it is written leaves the jobs running, to be
/// rescued: never lost.
fn finisher(shared: &Shared) {
    let mut conn = Connection::new(&shared.config.pool);
    let mut pause = Duration::from_millis(100);
    loop {
        let batch: Vec<Settle> = {
            let mut state = shared.lock();
            while state.settle.is_empty() {
                if state.closing {
                    return;
                }
                state = shared.wait(state, shared.config.poll_interval);
            }
            let n = state.settle.len().min(jobs::MAX_BATCH);
            let batch: Vec<Settle> = state.settle.drain(..n).collect();
            state.settling = batch.len();
            batch
        };
        let ids: Vec<i64> = batch.iter().map(|s| s.claim().id).collect();
        match record(shared, &mut conn, &batch) {
            Ok(()) => {
                pause = Duration::from_millis(100);
                let mut state = shared.lock();
                for id in ids {
                    state.held.remove(&id);
                }
                state.settling = 0;
                drop(state);
                shared.changed.notify_all();
            }
            Err(e) => {
                let mut state = shared.lock();
                state.settling = 0;
                if state.closing {
                    tracing::warn!(error = %e, jobs = ids.len(), "shutdown: recording finished jobs failed; they will be rescued");
                    for id in ids {
                        state.held.remove(&id);
                    }
                    return;
                }
                tracing::warn!(error = %e, jobs = ids.len(), ?pause, "recording finished jobs failed; retrying");
                let mut again = batch;
                again.append(&mut state.settle);
                state.settle = again;
                drop(shared.wait(state, pause));
                pause = (pause * 2).min(Duration::from_secs(5));
            }
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
                if state.closing {
                    return;
                }
                let now = Instant::now();
                let next_timeout = state
                    .held
                    .values()
                    .filter(|r| r.phase == Phase::Active)
                    .filter_map(|r| Some(r.started? + r.timeout?))
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
                .held
                .values()
                .filter(|r| r.phase == Phase::Active)
                .filter(|r| {
                    r.started
                        .zip(r.timeout)
                        .is_some_and(|(started, t)| now.duration_since(started) >= t)
                })
                .map(|r| r.claim.id)
                .collect();
            expired
                .into_iter()
                .filter_map(|id| state.held.remove(&id))
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
        let claims: Vec<JobClaim> = shared.lock().held.values().map(|r| r.claim).collect();
        for batch in claims.chunks(jobs::MAX_BATCH) {
            match conn.with(|c| jobs::renew(c, batch, config.lease_ttl)) {
                Ok(outcomes) => {
                    let mut state = shared.lock();
                    for (claim, outcome) in batch.iter().zip(outcomes) {
                        if matches!(outcome, Outcome::Lost | Outcome::Cancelled)
                            && let Some(running) = state.held.get(&claim.id)
                        {
                            running.stop.store(true, Ordering::SeqCst);
                            tracing::warn!(
                                job.id = claim.id,
                                ?outcome,
                                "heartbeat: the claim ended"
                            );
                            // Not started yet: it will not be.
                            if running.phase == Phase::Queued {
                                state.held.remove(&claim.id);
                            }
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

    /// How often the listener reads its connection. diesel's notification iterator does not
    /// block and does not expose the socket to wait on, so this bounds the added latency:
    /// a read of nothing pending is one non-blocking `recv`, about a microsecond of CPU.
    #[cfg(feature = "postgres")]
    const LISTEN_POLL: std::time::Duration = std::time::Duration::from_millis(1);

    /// LISTENs on a dedicated connection and wakes the claimer when a job is enqueued on one
    /// of its queues; polls the connection every [`LISTEN_POLL`]; reconnects with backoff
    /// when the connection breaks (polling keeps working).
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
                        for queue in &queues {
                            shared.wake(queue);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "listener: connection lost; reconnecting");
                        break;
                    }
                }
                std::thread::sleep(LISTEN_POLL);
            }
        }
    }
}

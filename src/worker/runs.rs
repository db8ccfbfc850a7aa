//! The worker's one table of runs, keyed by the claim (job id and token), and the state the
//! worker's threads share. Each transition has one owner:
//!
//! | transition | owner |
//! |---|---|
//! | (none) -> `Queued` | the claimer ([`State::claimed`]) |
//! | `Queued` -> `Active`, or -> `Finishing` (given back unstarted) | a handler thread ([`State::start`]) |
//! | `Active` -> `Finishing` | the same handler thread ([`State::returned`]) |
//! | `Finishing` -> (removed) | the finisher, once the run is recorded ([`State::recorded`]) |
//! | `Queued`/`Active` -> (removed) at shutdown | [`State::take_unfinished`] |
//!
//! The heartbeat changes no phase: it raises a run's stop flag (claim lost or cancelled,
//! timeout passed) and marks a timeout. A run is recorded only after its handler returned,
//! so a job stays `running` in the database (and holds its limit key) for as long as a
//! handler runs it, and a retry of the same job is another claim: another entry.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::job::RunNotes;
use super::{Handler, Task};
use crate::events::{self, Event, Hook, RunEvent, RunOutcome};
use crate::jobs::{Backoff, ClaimedJob, JobClaim, JobResult, Retry};
use crate::{Pool, jobs};

pub(crate) struct Config {
    pub pool: Pool,
    pub queues: Vec<String>,
    pub threads: usize,
    pub kinds: HashMap<String, Kind>,
    /// The kinds the worker claims (those it has handlers for), sorted.
    pub kind_names: Vec<String>,
    pub claim_ttl: Duration,
    pub poll_interval: Duration,
    pub retention: Vec<(String, jobs::Finished, jobs::Retention)>,
    /// Priority aging of the worker's queues: after how long a due job moves to the front.
    pub aging: Option<Duration>,
    pub run_schedules: bool,
    /// The most jobs claimed ahead of the threads.
    pub prefetch: usize,
    pub hooks: Vec<Hook>,
    /// The most runs one drain makes.
    pub drain_limit: usize,
}

/// A kind this worker runs: its handler, retry policy and timeout.
pub(crate) struct Kind {
    pub handler: Arc<Handler>,
    pub backoff: Backoff,
    pub timeout: Option<Duration>,
}

/// What a worker did, from its start until [`super::WorkerHandle::shutdown`] returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Runs that completed their job.
    pub completed: usize,
    /// Runs that failed and left the job waiting for a retry.
    pub retried: usize,
    /// Runs that snoozed their job ([`super::JobError::snooze`]).
    pub snoozed: usize,
    /// Runs after which the job is dead (failed for good, attempts used up, undecodable).
    pub dead: usize,
    /// Runs whose claim was lost before they finished (rescued or taken over).
    pub lost: usize,
    /// Runs that parked their job ([`super::JobError::parked`]).
    pub parked: usize,
    /// Runs whose job was cancelled while they ran.
    pub cancelled: usize,
    /// Runs that panicked (also counted under how they were recorded: retried, dead,
    /// cancelled or lost).
    pub panicked: usize,
    /// Runs that passed their kind's timeout (also counted under how they were recorded:
    /// retried, dead, cancelled or lost).
    pub timed_out: usize,
    /// Jobs given back at shutdown: claimed ahead and not started, or stopped by their
    /// handler when asked to, after the grace period.
    pub given_back: usize,
}

/// Where a claimed job is in this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Claimed, waiting for a handler thread (claimed ahead).
    Queued,
    /// A handler runs it, since this instant.
    Active(Instant),
    /// Its handler returned (or it was given back unstarted); the finisher has not recorded
    /// it yet.
    Finishing,
}

/// What a claimed job's events say about it.
#[derive(Debug, Clone)]
pub(super) struct RunInfo {
    pub id: i64,
    pub queue: Arc<str>,
    pub kind: Arc<str>,
    pub attempt: u32,
    pub max_attempts: u32,
    /// From its due time to this claim, by the database's clock.
    pub queue_wait: Duration,
}

impl RunInfo {
    pub fn of(job: &ClaimedJob) -> RunInfo {
        RunInfo {
            id: job.id,
            queue: Arc::from(job.queue.as_str()),
            kind: Arc::from(job.kind.as_str()),
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            queue_wait: (job.claimed_at - job.due_at).to_std().unwrap_or_default(),
        }
    }
}

/// One claim this worker holds.
pub(super) struct Run {
    pub info: RunInfo,
    pub stop: Arc<AtomicBool>,
    pub phase: Phase,
    pub timeout: Option<Duration>,
    /// Past its timeout: recorded as a timed-out failure when the handler returns.
    pub timed_out: bool,
    /// Its handler panicked.
    pub panicked: bool,
    /// How long its handler ran, once it returned.
    pub run_time: Option<Duration>,
    /// Its result and progress, as its handler set them.
    pub notes: Arc<RunNotes>,
}

impl Run {
    /// The event of this run, recorded with `outcome`.
    pub fn event(&self, outcome: RunOutcome, error: Option<String>) -> Event {
        let info = &self.info;
        Event::Run(RunEvent {
            id: info.id,
            queue: info.queue.clone(),
            kind: info.kind.clone(),
            attempt: info.attempt,
            max_attempts: info.max_attempts,
            outcome,
            error,
            run_time: self.run_time,
            queue_wait: info.queue_wait,
            panicked: self.panicked,
            timed_out: self.timed_out,
        })
    }
}

/// How a run is to be recorded (by the finisher).
#[derive(Debug, Clone)]
pub(super) enum Settle {
    /// With the result its handler set, if any, and the progress it set since the
    /// heartbeat last wrote it (written before the completion, so the last value stays).
    Complete(JobClaim, Option<JobResult>, Option<(f64, String)>),
    Fail {
        claim: JobClaim,
        message: String,
        retry: Retry,
        exhausted: bool,
        /// The kind's policy: used instead of `retry` if the database cannot store it.
        backoff: Backoff,
    },
    /// Back in the queue after `delay`, without using an attempt (within the bound).
    Snooze { claim: JobClaim, delay: Duration },
    /// Not started: its claim ended first, or the worker is stopping.
    GiveBack(JobClaim),
    /// Parked ([`super::JobError::parked`]) after the run recorded its park.
    Park(JobClaim),
}

impl Settle {
    pub fn claim(&self) -> JobClaim {
        match self {
            Settle::Complete(claim, ..)
            | Settle::Fail { claim, .. }
            | Settle::Snooze { claim, .. }
            | Settle::GiveBack(claim)
            | Settle::Park(claim) => *claim,
        }
    }
}

/// What a handler thread does with a task it took.
pub(super) enum Start {
    Run,
    /// Its claim ended before it started: give it back (the outcome says lost or cancelled).
    GiveBack,
    /// Not held any more (the worker is stopping): drop it.
    Skip,
}

pub(super) struct State {
    /// Every claim this worker holds, whatever its phase; the heartbeat renews them all.
    pub runs: HashMap<JobClaim, Run>,
    pub queued: usize,
    pub active: usize,
    /// Runs waiting for the finisher, and how many it is recording right now.
    pub settle: Vec<Settle>,
    pub settling: usize,
    /// The claimer stops; queued jobs are no longer started.
    pub stopping: bool,
    /// Shutdown passed its grace period: runs still inside their handler were asked to stop,
    /// and a run whose handler returns now is given back, not recorded.
    pub past_grace: bool,
    /// Past the grace period: the finisher records what is left and exits, the heartbeat
    /// exits.
    pub closing: bool,
    /// Set by the listener, a local enqueue or a freed thread to cut the claimer's idle wait
    /// short.
    pub woken: bool,
    /// Moving average of a handler's run time, in seconds: it sizes the prefetch.
    pub average_run: Option<f64>,
    /// A job whose claims lapsed before (a suspect: it may be what took a worker down) is
    /// running: others wait in `suspects`, so that a crash is charged to one job only.
    pub suspect_running: bool,
    /// Suspects waiting for the one running, in claim order (still queued: not started).
    pub suspects: VecDeque<Task>,
    pub report: Report,
}

/// How much work, in handler time, a worker claims ahead of its threads.
const PREFETCH_HORIZON: Duration = Duration::from_millis(20);

impl State {
    fn new() -> State {
        State {
            runs: HashMap::new(),
            queued: 0,
            active: 0,
            settle: Vec::new(),
            settling: 0,
            stopping: false,
            past_grace: false,
            closing: false,
            woken: false,
            average_run: None,
            suspect_running: false,
            suspects: VecDeque::new(),
            report: Report::default(),
        }
    }

    /// How many jobs to hold beyond one per thread: about [`PREFETCH_HORIZON`] of work, at
    /// most `max` (none until a run was timed, and none for slow jobs, which other workers
    /// should be free to take).
    pub fn prefetch(&self, threads: usize, max: usize) -> usize {
        match self.average_run {
            Some(average) if average > 0.0 => {
                let jobs = threads as f64 * PREFETCH_HORIZON.as_secs_f64() / average;
                (jobs as usize).min(max)
            }
            Some(_) => max,
            None => 0,
        }
    }

    /// The claimer: a new claim, queued for a thread. Returns its stop flag and its notes.
    pub fn claimed(
        &mut self,
        claim: JobClaim,
        info: RunInfo,
        timeout: Option<Duration>,
    ) -> (Arc<AtomicBool>, Arc<RunNotes>) {
        let stop = Arc::new(AtomicBool::new(false));
        let notes = Arc::new(RunNotes::default());
        self.queued += 1;
        self.runs.insert(
            claim,
            Run {
                info,
                stop: stop.clone(),
                phase: Phase::Queued,
                timeout,
                timed_out: false,
                panicked: false,
                run_time: None,
                notes: notes.clone(),
            },
        );
        (stop, notes)
    }

    /// A handler thread took the task of `claim`.
    pub fn start(&mut self, claim: JobClaim) -> Start {
        self.queued = self.queued.saturating_sub(1);
        if self.stopping {
            // Shutting down: a job claimed ahead is given back by the shutdown, not started.
            return Start::Skip;
        }
        let Some(run) = self.runs.get_mut(&claim) else {
            return Start::Skip;
        };
        if run.stop.load(Ordering::SeqCst) {
            run.phase = Phase::Finishing;
            self.settle.push(Settle::GiveBack(claim));
            return Start::GiveBack;
        }
        run.phase = Phase::Active(Instant::now());
        self.active += 1;
        Start::Run
    }

    /// The handler thread of `claim` returned after `took`; `settle` is how to record the run
    /// (the caller made it a timeout failure if the run was marked timed out). A run no
    /// longer held (given back at shutdown) is dropped.
    pub fn returned(&mut self, claim: JobClaim, settle: Settle, took: Duration) {
        self.active = self.active.saturating_sub(1);
        let took = took.as_secs_f64();
        self.average_run = Some(match self.average_run {
            Some(average) => average * 0.9 + took * 0.1,
            None => took,
        });
        if let Some(run) = self.runs.get_mut(&claim) {
            run.phase = Phase::Finishing;
            run.run_time = Some(Duration::from_secs_f64(took));
            self.settle.push(settle);
        }
        self.woken = true;
    }

    /// The finisher recorded (or gave up on) these claims: they are no longer held.
    pub fn recorded(&mut self, claims: impl IntoIterator<Item = JobClaim>) {
        for claim in claims {
            self.runs.remove(&claim);
        }
    }

    /// The heartbeat: runs past their timeout get their stop flag raised and are marked, so
    /// that they are recorded as timed out when their handler returns. Returns the earliest
    /// timeout still ahead.
    pub fn mark_timeouts(&mut self, now: Instant) -> Option<Instant> {
        let mut next = None;
        for run in self.runs.values_mut() {
            let (Phase::Active(started), Some(timeout), false) =
                (run.phase, run.timeout, run.timed_out)
            else {
                continue;
            };
            // A timeout past what an Instant holds never passes (not an overflow panic that
            // would take the heartbeat down, and the worker's claims with it).
            let Some(at) = started.checked_add(timeout) else {
                continue;
            };
            if now >= at {
                run.timed_out = true;
                run.stop.store(true, Ordering::SeqCst);
            } else {
                next = Some(next.map_or(at, |n: Instant| n.min(at)));
            }
        }
        next
    }

    /// The heartbeat: this claim ended (lost or cancelled). Its handler is told to stop; a
    /// queued one will be given back unstarted. It stays held until recorded.
    pub fn claim_ended(&mut self, claim: JobClaim) -> bool {
        match self.runs.get(&claim) {
            Some(run) => {
                run.stop.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Shutdown, at the end of the grace period: every run still inside its handler is asked
    /// to stop; one that returns now is given back.
    pub fn ask_to_stop(&mut self) {
        self.past_grace = true;
        for run in self.runs.values() {
            if matches!(run.phase, Phase::Active(_)) {
                run.stop.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Shutdown, last: every claim not finishing stops being held. Returns the queued ones
    /// (never started: to give back at once) and how many runs are still inside their
    /// handler: those are not given back while the handler may still be working on them
    /// (no second run may start meanwhile, and the job keeps its limit slot); their claims
    /// lapse, unrenewed, and a rescue returns them without using an attempt.
    pub fn take_unfinished(&mut self) -> (Vec<(JobClaim, Run)>, usize) {
        let mut queued = Vec::new();
        let mut running = 0;
        let unfinished: Vec<JobClaim> = self
            .runs
            .iter()
            .filter(|(_, run)| run.phase != Phase::Finishing)
            .map(|(claim, _)| *claim)
            .collect();
        for claim in unfinished {
            let Some(run) = self.runs.remove(&claim) else {
                continue;
            };
            run.stop.store(true, Ordering::SeqCst);
            match run.phase {
                Phase::Queued => queued.push((claim, run)),
                _ => running += 1,
            }
        }
        (queued, running)
    }
}

pub(super) struct Shared {
    pub config: Config,
    state: Mutex<State>,
    pub changed: Condvar,
    /// The worker's registration (`tenure_workers`), recorded in its claims.
    pub registration: super::liveness::Current,
}

impl Shared {
    pub fn new(config: Config) -> Arc<Shared> {
        Arc::new(Shared {
            config,
            state: Mutex::new(State::new()),
            changed: Condvar::new(),
            registration: Default::default(),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn wait<'a>(
        &'a self,
        state: MutexGuard<'a, State>,
        timeout: Duration,
    ) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(state, timeout)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    pub fn stopping(&self) -> bool {
        self.lock().stopping
    }

    pub fn count(&self, f: impl FnOnce(&mut Report)) {
        f(&mut self.lock().report);
    }

    /// Logs `event`, counts it as metrics (with the feature) and hands it to the hooks.
    /// Call without the state's lock held: hooks may be slow. A hook that panics (a bug in
    /// it) is logged and the other hooks still get the event: the panic must not unwind
    /// through the worker's own thread (the finisher's: runs would stay unrecorded, their
    /// jobs held and renewed for as long as the worker lives).
    /// Whether run events have anyone to go to: hooks, the `metrics` feature, or a `tracing`
    /// subscriber that wants `tenure::job` lines. Otherwise they are not built at all (a worker
    /// nobody watches pays nothing for them).
    pub fn wants_events(&self) -> bool {
        !self.config.hooks.is_empty()
            || cfg!(feature = "metrics")
            || tracing::enabled!(target: "tenure::job", tracing::Level::WARN)
    }

    pub fn emit(&self, event: Event) {
        events::log(&event);
        #[cfg(feature = "metrics")]
        crate::metrics::record_event(&event);
        for hook in &self.config.hooks {
            let called = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&event)));
            if let Err(panic) = called {
                let message = super::handlers::panic_message(panic.as_ref());
                tracing::error!(target: "tenure::worker", panic = %message, "an on_event hook panicked; the worker goes on");
            }
        }
    }
}

impl crate::wake::Waker for Shared {
    /// Wakes the claimer if it serves `queue`.
    fn wake(&self, queue: &str) {
        if self.config.queues.iter().any(|q| q == queue) {
            self.lock().woken = true;
            self.changed.notify_all();
        }
    }
}

/// Cuts claims into groups for one call each: at most [`jobs::MAX_BATCH`], and no job id
/// twice in one group (a job's stale claim and its retry's claim can both be held for a
/// moment; the calls refuse a group that names a job twice).
pub(super) fn claim_groups(claims: &[JobClaim]) -> Vec<Vec<JobClaim>> {
    let mut groups: Vec<(std::collections::HashSet<i64>, Vec<JobClaim>)> = Vec::new();
    for claim in claims {
        let fits = groups
            .iter()
            .position(|(ids, group)| group.len() < jobs::MAX_BATCH && !ids.contains(&claim.id));
        let index = match fits {
            Some(index) => index,
            None => {
                groups.push(Default::default());
                groups.len() - 1
            }
        };
        let (ids, group) = &mut groups[index];
        ids.insert(claim.id);
        group.push(*claim);
    }
    groups.into_iter().map(|(_, group)| group).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_never_name_a_job_twice() {
        let claim = |id: i64| JobClaim {
            id,
            token: uuid::Uuid::new_v4(),
        };
        let claims = vec![claim(1), claim(2), claim(1), claim(3), claim(1)];
        let cut = claim_groups(&claims);
        assert_eq!(cut.len(), 3);
        for group in &cut {
            let mut ids: Vec<i64> = group.iter().map(|c| c.id).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), group.len());
        }
        assert_eq!(cut.iter().map(Vec::len).sum::<usize>(), claims.len());
        let many: Vec<JobClaim> = (0..2500).map(claim).collect();
        let sizes: Vec<usize> = claim_groups(&many).iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![1000, 1000, 500]);
    }
}

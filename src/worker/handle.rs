//! Starting a worker's threads, the handle that stops them, and `drain` (a run of the due jobs on the calling thread).

use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::connection::Connection;
use super::runs::{Config, Report, RunInfo, Shared, claim_groups};
use super::{Task, claimer, finisher, handlers, heartbeat, listener, liveness, maintenance};
use crate::Error;
use crate::events::RunOutcome;
use crate::jobs::{self, Outcome};

/// A running worker. [`WorkerHandle::shutdown`] stops it gracefully; dropping the handle
/// shuts it down with no grace period (unfinished jobs are given back at once).
pub struct WorkerHandle {
    shared: Arc<Shared>,
    claimer: Option<JoinHandle<()>>,
    maintenance: Option<JoinHandle<()>>,
    finisher: Option<JoinHandle<()>>,
    heartbeat: Option<JoinHandle<()>>,
    listener: Option<JoinHandle<()>>,
    /// Keeps the worker's registration; told to unregister by dropping its sender.
    liveness: Option<(JoinHandle<()>, std::sync::mpsc::Sender<()>)>,
    handlers: Vec<JoinHandle<()>>,
    done: bool,
}

/// How long shutdown waits, past the grace period, for handlers told to stop.
const STOP_WAIT: Duration = Duration::from_secs(1);

/// Runs due jobs on the calling thread until none is due ([`super::WorkerBuilder::drain`]).
/// Each run goes through the same table of runs and the same recording as a started
/// worker's, so reports and events are alike; no connection is held while a handler runs.
pub(crate) fn drain(config: Config) -> crate::Result<Report> {
    let shared = Shared::new(config);
    let config = &shared.config;
    let mut runs = 0;
    loop {
        let mut ran = false;
        for queue in &config.queues {
            let claimed = shared.config.pool.get().and_then(|mut c| {
                jobs::claim_kinds(&mut c, queue, &config.kind_names, 1, config.claim_ttl)
            })?;
            for job in claimed {
                if runs >= config.drain_limit {
                    // Still due after the limit: give it back (no attempt used) and say so.
                    shared
                        .config
                        .pool
                        .get()
                        .and_then(|mut c| jobs::give_back(&mut c, &[job.claim()]))?;
                    return Err(Error::Timeout {
                        what: "a drain to end: it ran its limit of runs and jobs are still due \
                               (does a handler enqueue another job every time? see \
                               WorkerBuilder::drain_limit)",
                    });
                }
                runs += 1;
                ran = true;
                let claim = job.claim();
                let timeout = config.kinds.get(&job.kind).and_then(|k| k.timeout);
                let (stop, notes) = shared.lock().claimed(claim, RunInfo::of(&job), timeout);
                shared.lock().start(claim);
                let started = Instant::now();
                let settle = handlers::run_one(&shared, &Task { job, stop, notes });
                shared
                    .lock()
                    .returned(claim, settle.clone(), started.elapsed());
                let mut conn = Connection::new(&config.pool);
                let (mut unrecorded, events) = finisher::record(&shared, &mut conn, &[settle]);
                // No connection held while the hooks run either: they may use the pool.
                drop(conn);
                if let Some((_, e)) = unrecorded.pop() {
                    tracing::warn!(error = %e, "finishing a job failed; it will be rescued");
                }
                {
                    let mut state = shared.lock();
                    state.recorded([claim]);
                    state.settle.clear();
                }
                for event in events {
                    shared.emit(event);
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
    let shared = Shared::new(config);
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
            format!("tenure-worker-{n}"),
            Box::new(move || handlers::run_handlers(&shared, &inbox)),
        )?);
    }
    let heartbeat = {
        let shared = shared.clone();
        spawn(
            "tenure-heartbeat".into(),
            Box::new(move || heartbeat::heartbeat(&shared)),
        )?
    };
    let finisher = {
        let shared = shared.clone();
        spawn(
            "tenure-finisher".into(),
            Box::new(move || finisher::finisher(&shared)),
        )?
    };
    let listener = if listen {
        let shared = shared.clone();
        Some(spawn(
            "tenure-listener".into(),
            Box::new(move || listener::listen(&shared)),
        )?)
    } else {
        None
    };
    let liveness = {
        let shared = shared.clone();
        let (stop, stopped) = channel::<()>();
        let thread = spawn(
            "tenure-liveness".into(),
            Box::new(move || liveness::keep_alive(&shared, stopped)),
        )?;
        (thread, stop)
    };
    let claimer = {
        let shared = shared.clone();
        spawn(
            "tenure-claimer".into(),
            Box::new(move || claimer::claim_loop(&shared, tasks)),
        )?
    };
    let maintenance = {
        let shared = shared.clone();
        spawn(
            "tenure-maintenance".into(),
            Box::new(move || maintenance::maintain(&shared)),
        )?
    };
    let waker: Arc<dyn crate::wake::Waker> = shared.clone();
    crate::wake::register(Arc::downgrade(&waker));
    Ok(WorkerHandle {
        shared,
        claimer: Some(claimer),
        maintenance: Some(maintenance),
        finisher: Some(finisher),
        heartbeat: Some(heartbeat),
        listener,
        liveness: Some(liveness),
        handlers,
        done: false,
    })
}

impl WorkerHandle {
    /// What the worker has done so far.
    pub fn report(&self) -> Report {
        self.shared.lock().report.clone()
    }

    /// Stops claiming and waits up to `grace` for running jobs to finish. Then it raises the
    /// [`super::JobContext::should_stop`] of the runs still going and waits up to one more
    /// second for them: a run whose handler returns then is given back (due again at once,
    /// no attempt used, so another worker takes it straight away). Jobs claimed ahead that
    /// no thread had started are given back. A handler still running after that keeps its
    /// job: no other run of it may start while it works, so its claim is left to lapse
    /// (within the claim ttl) and the rescue returns it, without using an attempt. Returns
    /// the report.
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
        for thread in [self.claimer.take(), self.maintenance.take()]
            .into_iter()
            .flatten()
        {
            let _ = thread.join();
        }
        let settled = |shared: &Shared, until: Instant| {
            let mut state = shared.lock();
            while (state.active > 0 || !state.settle.is_empty() || state.settling > 0)
                && Instant::now() < until
            {
                let left = until.saturating_duration_since(Instant::now());
                state = shared.wait(state, left);
            }
        };
        settled(&self.shared, Instant::now() + grace);
        // Past the grace period: runs still inside their handler are asked to stop, and those
        // that do (within STOP_WAIT) are given back, renewed meanwhile.
        self.shared.lock().ask_to_stop();
        settled(&self.shared, Instant::now() + STOP_WAIT);
        let (queued, running) = {
            let mut state = self.shared.lock();
            let unfinished = state.take_unfinished();
            state.closing = true;
            unfinished
        };
        self.shared.changed.notify_all();
        if running > 0 {
            tracing::warn!(
                runs = running,
                "shutdown: handlers still running past the grace period; their claims lapse unrenewed and the rescue returns their jobs"
            );
        }
        if !queued.is_empty() {
            let claims: Vec<_> = queued.iter().map(|(claim, _)| *claim).collect();
            let given_back = self.shared.config.pool.get().and_then(|mut conn| {
                let mut outcomes = Vec::with_capacity(claims.len());
                for group in claim_groups(&claims) {
                    outcomes.extend(jobs::give_back(&mut conn, &group)?);
                }
                Ok(outcomes)
            });
            match given_back {
                Ok(outcomes) => {
                    tracing::info!(
                        jobs = outcomes.len(),
                        "shutdown: gave back jobs claimed ahead"
                    );
                    for ((_, run), outcome) in queued.iter().zip(outcomes) {
                        let recorded = match outcome {
                            Outcome::Done | Outcome::AlreadyDone => RunOutcome::GivenBack,
                            Outcome::Cancelled => RunOutcome::Cancelled,
                            Outcome::Lost => RunOutcome::Lost,
                        };
                        self.shared.count(|r| match recorded {
                            RunOutcome::GivenBack => r.given_back += 1,
                            RunOutcome::Cancelled => r.cancelled += 1,
                            _ => r.lost += 1,
                        });
                        self.shared.emit(run.event(recorded, None));
                    }
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
        // Last, once every run was recorded or given back: the worker unregisters (runs still
        // in their handlers keep their claims under the ttl alone) and releases its lock.
        if let Some((thread, stop)) = self.liveness.take() {
            drop(stop);
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

//! Handler threads: each takes claimed jobs from the claimer, runs the handler (catching a
//! panic), and hands the run to the finisher. They need no connection of their own.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::Receiver;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::job::WorkerPool;
use super::runs::{Settle, Shared, Start};
use super::{Action, HandlerFailure, JobContext, JobError, Task};
use crate::jobs::{ClaimedJob, Retry};

/// Runs tasks until the claimer closes the channel. A job whose claims lapsed before (a
/// suspect) runs alone among suspects, its start recorded first: if it takes the worker down,
/// the crash is charged to it; the jobs claimed ahead beside it never started and are not.
pub(super) fn run_handlers(shared: &Shared, inbox: &Mutex<Receiver<Task>>) {
    loop {
        let task = {
            let inbox = inbox.lock().unwrap_or_else(PoisonError::into_inner);
            inbox.recv()
        };
        let Ok(task) = task else { return };
        if task.job.lapses == 0 {
            handle(shared, &task, false);
            continue;
        }
        {
            let mut state = shared.lock();
            if state.suspect_running {
                state.suspects.push_back(task);
                continue;
            }
            state.suspect_running = true;
        }
        // This thread runs the suspects that waited for it, one after another.
        let mut next = Some(task);
        while let Some(task) = next.take() {
            handle(shared, &task, true);
            // Until its outcome is recorded: a crash before that would lapse its claim too,
            // with its start recorded, and charge it beside the next suspect.
            let claim = task.job.claim();
            let mut state = shared.lock();
            while state.runs.contains_key(&claim) && !state.closing {
                state = shared.wait(state, Duration::from_millis(100));
            }
            next = state.suspects.pop_front();
            state.suspect_running = next.is_some();
        }
    }
}

/// Starts, runs and hands over one task (a suspect's start recorded first).
fn handle(shared: &Shared, task: &Task, suspect: bool) {
    let claim = task.job.claim();
    let start = shared.lock().start(claim);
    shared.changed.notify_all();
    if !matches!(start, Start::Run) {
        return;
    }
    if suspect {
        let recorded = shared
            .config
            .pool
            .get()
            .and_then(|mut conn| crate::jobs::record_start(&mut conn, claim));
        if let Err(e) = recorded {
            // Run it anyway: a lapse of this run then counts only as the first did.
            tracing::warn!(job.id = claim.id, error = %e, "recording a run's start failed");
        }
    }
    let started = Instant::now();
    let settle = run_one(shared, task);
    let took = started.elapsed();
    let mut state = shared.lock();
    // Past its timeout by the heartbeat's mark or by its own clock: a heartbeat starved
    // on a loaded machine may not have looked before the handler returned.
    let timed_out = state.runs.get(&claim).and_then(|run| {
        let past = run.timed_out || run.timeout.is_some_and(|timeout| took >= timeout);
        past.then(|| (run.timeout.unwrap_or_default(), run.info.kind.clone()))
    });
    let settle = match timed_out {
        // A run that parked and returned parked handed its token out: the job waits for it,
        // past the grace or the timeout too (parking ends the run as a give-back would).
        _ if matches!(settle, Settle::Park(_)) => settle,
        // Shutdown asked it to stop: its job goes back to the queue, no attempt used.
        _ if state.past_grace => Settle::GiveBack(claim),
        // Past its timeout the run is a failure, whatever the handler returned late.
        Some((timeout, kind)) => {
            state.report.timed_out += 1;
            failed(
                shared,
                &task.job,
                &kind,
                JobError::retry(format!("timed out after {timeout:?}")),
            )
        }
        None => settle,
    };
    state.returned(claim, settle, took);
    drop(state);
    shared.changed.notify_all();
}

/// Runs one job's handler (catching a panic) and says how to record the run.
pub(super) fn run_one(shared: &Shared, task: &Task) -> Settle {
    let Task { job, stop, notes } = task;
    let ctx = JobContext {
        id: job.id,
        queue: job.queue.clone(),
        kind: job.kind.clone(),
        attempt: job.attempt,
        max_attempts: job.max_attempts,
        enqueued_at: job.created_at,
        due_at: job.due_at,
        claimed_at: job.claimed_at,
        claim: job.claim(),
        stop: stop.clone(),
        notes: notes.clone(),
        pool: WorkerPool(Some(shared.config.pool.clone())),
        backoff: shared
            .config
            .kinds
            .get(&job.kind)
            .map(|k| k.backoff)
            .unwrap_or_default(),
        for_test: false,
    };
    let span = tracing::info_span!(
        target: "tenure::worker",
        "tenure.job",
        job.id = job.id,
        queue = %job.queue,
        kind = %job.kind,
        attempt = job.attempt,
        queue_wait_ms = crate::events::milliseconds(ctx.queue_wait()),
        result = tracing::field::Empty,
        run_ms = tracing::field::Empty,
    );
    let _entered = span.enter();
    let started = std::time::Instant::now();
    let mut panicked = false;
    let outcome = match shared.config.kinds.get(&job.kind) {
        // Not claimed (the claim asks only for kinds with handlers): kept for safety.
        None => Err(HandlerFailure::Job(JobError::retry(format!(
            "no handler for kind {:?} on this worker",
            job.kind
        )))),
        Some(kind) => match catch_unwind(AssertUnwindSafe(|| (kind.handler)(&ctx, &job.payload))) {
            Ok(outcome) => outcome,
            Err(panic) => {
                panicked = true;
                let message = panic_message(panic.as_ref());
                Err(HandlerFailure::Job(JobError::retry(format!(
                    "the handler panicked: {message}"
                ))))
            }
        },
    };
    span.record("run_ms", crate::events::milliseconds(started.elapsed()));
    span.record(
        "result",
        match (&outcome, panicked) {
            (_, true) => "panic",
            (Ok(()), _) => "ok",
            (Err(_), _) => "error",
        },
    );
    if panicked {
        let mut state = shared.lock();
        state.report.panicked += 1;
        if let Some(run) = state.runs.get_mut(&job.claim()) {
            run.panicked = true;
        }
    }
    match outcome {
        Ok(()) => Settle::Complete(job.claim(), notes.take_result(), notes.take_progress()),
        Err(HandlerFailure::Undecodable(message)) => Settle::Fail {
            claim: job.claim(),
            message,
            retry: Retry::Never,
            exhausted: true,
            backoff: Default::default(),
        },
        // Parked by the park this run recorded; without one, a failure that says so.
        Err(HandlerFailure::Job(error)) if error.action == Action::Park => {
            if notes.parked.load(std::sync::atomic::Ordering::SeqCst) {
                Settle::Park(job.claim())
            } else {
                failed(
                    shared,
                    job,
                    &job.kind,
                    JobError::retry(
                        "the handler returned JobError::parked() without JobContext::park",
                    ),
                )
            }
        }
        Err(HandlerFailure::Job(error)) => failed(shared, job, &job.kind, error),
    }
}

/// A failed run, retried per the kind's policy or the error's instruction.
fn failed(shared: &Shared, job: &ClaimedJob, kind: &str, error: JobError) -> Settle {
    let backoff = shared
        .config
        .kinds
        .get(kind)
        .map(|k| k.backoff)
        .unwrap_or_default();
    let retry = match error.action {
        Action::Retry => Retry::Backoff(backoff),
        Action::RetryAt(at) => Retry::At(at),
        Action::Dead => Retry::Never,
        Action::Snooze(delay) => {
            return Settle::Snooze {
                claim: job.claim(),
                delay,
            };
        }
        // Past its timeout or shutting down: a park is a failure like any late return.
        Action::Park => Retry::Backoff(backoff),
    };
    Settle::Fail {
        claim: job.claim(),
        exhausted: job.attempt >= job.max_attempts || retry == Retry::Never,
        message: error.message,
        retry,
        backoff,
    }
}

/// The text a panic carried (`panic!("...")` gives a `&str` or a `String`).
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

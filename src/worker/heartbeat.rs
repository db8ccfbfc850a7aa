//! The heartbeat: renews every claim the worker holds every ttl/3 on a connection of its own,
//! raises the stop flag of runs whose claim was lost or cancelled, and of runs past their
//! timeout. Every [`PROGRESS_PERIOD`] it writes the worker's own heartbeat (`tenure_workers`:
//! it lives, see `jobs::registry`) and the progress handlers reported, only for runs whose
//! progress changed. It writes nothing else: a run is recorded only when its handler returns.

use std::time::{Duration, Instant};

use super::connection::Connection;
use super::runs::{Shared, claim_groups};
use crate::jobs::{self, JobClaim, Outcome};

pub(super) fn heartbeat(shared: &Shared) {
    let config = &shared.config;
    let mut conn = Connection::new(&config.pool);
    let period = config.claim_ttl / 3;
    let mut next_beat = Instant::now() + period;
    let mut next_progress = Instant::now() + PROGRESS_PERIOD;
    loop {
        // Sleep until the next beat or the earliest timeout, whichever comes first; other
        // wake-ups (a job finished) do not make beats more frequent.
        {
            let mut state = shared.lock();
            loop {
                if state.closing {
                    return;
                }
                let now = Instant::now();
                let next_timeout = state.mark_timeouts(now);
                if now >= next_beat || now >= next_progress {
                    break;
                }
                let until = next_timeout.map_or(next_beat, |t| t.min(next_beat));
                state = shared.wait(state, until.min(next_progress) - now);
            }
        }
        if Instant::now() >= next_progress {
            next_progress = Instant::now() + PROGRESS_PERIOD;
            beat(shared, &mut conn);
            write_progress(shared, &mut conn);
        }
        if Instant::now() < next_beat {
            continue;
        }
        next_beat = Instant::now() + period;
        let claims: Vec<JobClaim> = shared.lock().runs.keys().copied().collect();
        for group in claim_groups(&claims) {
            match conn.with(|c| jobs::renew(c, &group, config.claim_ttl)) {
                Ok(outcomes) => {
                    let mut state = shared.lock();
                    for (claim, outcome) in group.iter().zip(outcomes) {
                        if matches!(outcome, Outcome::Lost | Outcome::Cancelled)
                            && state.claim_ended(*claim)
                        {
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

/// How often, at most, the progress of a run is written; how often the worker's heartbeat is.
pub(super) const PROGRESS_PERIOD: Duration = jobs::registry::WORKER_BEAT;

/// Says the worker lives; a row found gone (a rescue took the worker for dead) makes it
/// register again.
fn beat(shared: &Shared, conn: &mut Connection<'_>) {
    let Some(id) = shared.registration.id() else {
        return;
    };
    match conn.with(|c| jobs::registry::beat(c, id)) {
        Ok(true) => {}
        Ok(false) => shared.registration.gone(id),
        Err(e) => tracing::warn!(error = %e, "the worker's heartbeat failed; retrying in a second"),
    }
}

/// Writes the progress of runs whose handler reported a new one since the last time: one
/// fenced write per such run, whatever the number of reports.
fn write_progress(shared: &Shared, conn: &mut Connection<'_>) {
    let changed: Vec<(JobClaim, (f64, String))> = shared
        .lock()
        .runs
        .iter()
        .filter_map(|(claim, run)| run.notes.take_progress().map(|p| (*claim, p)))
        .collect();
    for (claim, (value, message)) in changed {
        if let Err(e) = conn.with(|c| jobs::record_progress(c, claim, value, &message)) {
            tracing::warn!(job.id = claim.id, error = %e, "writing a run's progress failed");
        }
    }
}

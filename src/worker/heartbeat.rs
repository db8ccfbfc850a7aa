//! The heartbeat: renews every claim the worker holds every ttl/3 on a connection of its own,
//! raises the stop flag of runs whose claim was lost or cancelled, and of runs past their
//! timeout. It writes nothing else: a run is recorded only when its handler returns.

use std::time::Instant;

use super::connection::Connection;
use super::runs::{Shared, batches};
use crate::jobs::{self, JobClaim, Outcome};

pub(super) fn heartbeat(shared: &Shared) {
    let config = &shared.config;
    let mut conn = Connection::new(&config.pool);
    let period = config.claim_ttl / 3;
    let mut next_beat = Instant::now() + period;
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
                if now >= next_beat {
                    break;
                }
                let until = next_timeout.map_or(next_beat, |t| t.min(next_beat));
                state = shared.wait(state, until - now);
            }
        }
        next_beat = Instant::now() + period;
        let claims: Vec<JobClaim> = shared.lock().runs.keys().copied().collect();
        for batch in batches(&claims) {
            match conn.with(|c| jobs::renew(c, &batch, config.claim_ttl)) {
                Ok(outcomes) => {
                    let mut state = shared.lock();
                    for (claim, outcome) in batch.iter().zip(outcomes) {
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

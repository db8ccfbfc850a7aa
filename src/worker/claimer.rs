//! The claimer: claims jobs for the free threads plus a prefetch sized by how fast jobs run,
//! hands them out, rotates the ready ring, and backs off while idle. The other passes run on
//! the maintenance thread (`maintenance.rs`), so none of them delays a claim.
//!
//! The rotation stays here: it delays claims wherever it runs (they wait behind its lock
//! while it empties a slot), and MariaDB grants its lock only in an instant when no open
//! transaction has used the ring. From the claimer, whose own transactions are the ring's
//! most frequent, it found one every second through bench G's 90 s hold; from a thread
//! beside it, about half as often even with 200 tries, and claims slowed with the
//! delete-marked entries left between rotations (held p50 12 -> 19 ms).

use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use super::Task;
use super::connection::Connection;
use super::runs::{RunInfo, Shared};
use crate::jobs;

/// How often a worker rotates the ready ring ([`jobs::rotate_ready`]; once for all workers of
/// a database, by the database's clock).
const ROTATE_EVERY: Duration = Duration::from_secs(1);

pub(super) fn claim_loop(shared: &Shared, tasks: Sender<Task>) {
    let config = &shared.config;
    shared.registration.wait_for_first(shared);
    let mut conn = Connection::new(&config.pool);
    let mut idle = Duration::from_millis(10);
    let mut error_pause = Duration::from_millis(100);
    let max_idle = config.poll_interval;
    let mut rotation_failures: u64 = 0;
    let mut next_rotation = Instant::now();
    let mut next_queue = 0;
    // When a rate that held jobs back has room again (from the claims' answers): an idle
    // wait ends then, so a rate-limited queue is claimed when its window allows, not at the
    // next doubling of the idle wait.
    let mut rate_frees: Option<Instant> = None;
    // After an error on this thread's connection: a claim may have committed while its answer
    // was lost. Once the database answers again, its record of this worker's claims is
    // compared with what the worker holds, and the difference given back.
    let mut unknown_claims = false;
    loop {
        let wanted = {
            let mut state = shared.lock();
            loop {
                if state.stopping {
                    return;
                }
                let prefetch = state.prefetch(config.threads, config.prefetch);
                // Suspects waiting for the one running (see `handlers::run_handlers`) leave
                // their threads free: up to one per thread, they do not count against claims.
                let waiting = state.suspects.len().min(config.threads);
                let in_hand = (state.active + state.queued).saturating_sub(waiting);
                let wanted = (config.threads + prefetch).saturating_sub(in_hand);
                // Claim again once the prefetched jobs run low (not for every freed
                // thread: fewer, bigger claims), and not while the finisher is far behind.
                let low = state.queued.saturating_sub(waiting) <= prefetch / 2;
                let backlog = state.settle.len() + state.settling;
                if wanted > 0 && low && backlog < jobs::MAX_BATCH {
                    break wanted.min(jobs::MAX_BATCH);
                }
                state = shared.wait(state, config.poll_interval);
            }
        };
        if unknown_claims {
            match conn.with(|c| give_back_unknown_claims(c, shared)) {
                Ok(0) => unknown_claims = false,
                Ok(given) => {
                    unknown_claims = false;
                    tracing::info!(target: "tenure::worker", jobs = given,
                        "gave back jobs claimed while the connection failed (the claim's answer was lost)");
                }
                Err(e) => tracing::debug!(target: "tenure::worker", error = %e,
                    "reading this worker's claims failed; trying again"),
            }
        }
        if Instant::now() >= next_rotation {
            let started = Instant::now();
            let outcome = conn.with(|c| jobs::rotate_ready(c, ROTATE_EVERY));
            // A rotation that moved many waiting jobs' entries (a backlog) is spaced out: at
            // most a twentieth of this thread's time.
            next_rotation = Instant::now() + ROTATE_EVERY.max(started.elapsed() * 20);
            match outcome {
                Ok(_) => rotation_failures = 0,
                Err(e) => {
                    unknown_claims = true;
                    // A failure that repeats (a user without the privileges MariaDB's rotation
                    // needs, docs/guide.md) is tried every half minute, and said the first time
                    // and then every hundredth.
                    next_rotation = Instant::now() + ROTATE_EVERY * 30;
                    if rotation_failures % 100 == 0 {
                        tracing::warn!(error = %e, failures = rotation_failures + 1,
                            "rotating the ready ring failed");
                    }
                    rotation_failures += 1;
                }
            }
        }
        let Some(queue) = config.queues.get(next_queue % config.queues.len().max(1)) else {
            return;
        };
        next_queue += 1;
        // Only kinds this worker has handlers for: other kinds wait for their workers. The
        // claims record this worker, so that they come back soon after it dies.
        let worker = shared.registration.id();
        let claim = |c: &mut _| {
            jobs::claim_kinds_throttled(
                c,
                queue,
                &config.kind_names,
                wanted,
                config.claim_ttl,
                worker,
            )
        };
        let claimed = conn.with(claim).map(|(claimed, throttled_for)| {
            if let Some(wait) = throttled_for {
                // A millisecond late, past the clock's rounding (SQLite keeps milliseconds).
                let frees = Instant::now() + wait + Duration::from_millis(1);
                rate_frees = Some(rate_frees.map_or(frees, |at| at.min(frees)));
            }
            claimed
        });
        match claimed {
            Ok(claimed) if !claimed.is_empty() => {
                idle = Duration::from_millis(10);
                error_pause = Duration::from_millis(100);
                tracing::debug!(target: "tenure::worker", %queue, jobs = claimed.len(), "claimed jobs");
                let mut state = shared.lock();
                for job in claimed {
                    let timeout = config.kinds.get(&job.kind).and_then(|k| k.timeout);
                    let (stop, notes) = state.claimed(job.claim(), RunInfo::of(&job), timeout);
                    if tasks.send(Task { job, stop, notes }).is_err() {
                        return;
                    }
                }
            }
            Ok(_) => {
                // Nothing due in this queue; after a full round of queues, wait.
                if next_queue % config.queues.len().max(1) == 0 {
                    let now = Instant::now();
                    let wait = match rate_frees.take() {
                        Some(at) if at > now => {
                            // Keep it for the next round if this wait ends first.
                            if at - now > idle {
                                rate_frees = Some(at);
                            }
                            idle.min(at - now)
                        }
                        _ => idle,
                    };
                    let mut state = shared.lock();
                    if !state.woken && !state.stopping {
                        state = shared.wait(state, wait);
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
                unknown_claims = true;
                tracing::warn!(error = %e, pause = ?error_pause, "claiming failed; backing off");
                let state = shared.lock();
                drop(shared.wait(state, error_pause));
                error_pause = (error_pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Gives back the jobs the database records as this worker's claims that the worker does not
/// hold (a claim whose answer was lost): due again at once, no attempt used, fenced by each
/// claim's token (a claim the finisher recorded meanwhile is left as it is). Returns how many
/// went back.
fn give_back_unknown_claims(
    conn: &mut crate::PooledConnection,
    shared: &Shared,
) -> crate::Result<usize> {
    let Some(worker) = shared.registration.id() else {
        return Ok(0);
    };
    let recorded = jobs::registry::held_claims(conn, worker)?;
    let unknown: Vec<_> = {
        let state = shared.lock();
        recorded
            .into_iter()
            .filter(|claim| !state.runs.contains_key(claim))
            .collect()
    };
    if unknown.is_empty() {
        return Ok(0);
    }
    let outcomes = jobs::give_back(conn, &unknown)?;
    Ok(outcomes
        .iter()
        .filter(|outcome| **outcome == jobs::Outcome::Done)
        .count())
}

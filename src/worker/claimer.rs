//! The claimer: claims jobs for the free threads plus a prefetch sized by how fast jobs run,
//! hands them out, rescues stalled jobs, fails parked jobs past their deadline, prunes, fires
//! schedules, and backs off while idle.

use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use super::Task;
use super::connection::Connection;
use super::runs::{RunInfo, Shared};
use crate::events::Event;
use crate::jobs::{self, Finished, Retention};

/// How often a worker that runs schedules fires them.
const SCHEDULES_EVERY: Duration = Duration::from_millis(100);

/// How often a worker fails parked jobs past their deadline ([`jobs::expire_parked`]): a
/// read of the open parks' index by deadline.
const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// How often a worker rotates the ready ring ([`jobs::rotate_ready`]; once for all workers of
/// a database, by the database's clock).
const ROTATE_EVERY: Duration = Duration::from_secs(1);

/// How often a worker with retention policies prunes.
const PRUNE_EVERY: Duration = Duration::from_secs(5);

pub(super) fn claim_loop(shared: &Shared, tasks: Sender<Task>) {
    let config = &shared.config;
    shared.registration.wait_for_first(shared);
    let mut conn = Connection::new(&config.pool);
    let mut idle = Duration::from_millis(10);
    let mut error_pause = Duration::from_millis(100);
    let rescue_every = (config.claim_ttl / 2).min(Duration::from_secs(30));
    let mut next_rescue = Instant::now();
    // Dead workers' claims are looked for often (the look is a read of a small table), and
    // first when this worker starts: a worker started in place of one that died takes its
    // jobs back within seconds.
    let mut next_dead_workers = Instant::now();
    let mut next_prune = Instant::now();
    let mut next_expire = Instant::now();
    let mut next_schedules = Instant::now();
    let mut rotation_failures: u64 = 0;
    let mut next_rotation = Instant::now();
    // With schedules to fire, idle waits stay short enough to fire them on time.
    let max_idle = if config.run_schedules {
        config.poll_interval.min(SCHEDULES_EVERY)
    } else {
        config.poll_interval
    };
    let mut next_queue = 0;
    // When a rate that held jobs back has room again (from the claims' answers): an idle
    // wait ends then, so a rate-limited queue is claimed when its window allows, not at the
    // next doubling of the idle wait.
    let mut rate_frees: Option<Instant> = None;
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
        if config.run_schedules && Instant::now() >= next_schedules {
            next_schedules = Instant::now() + SCHEDULES_EVERY;
            match conn.with(crate::schedules::tick) {
                Ok(0) => {}
                Ok(enqueued) => shared.emit(Event::SchedulesFired { enqueued }),
                Err(e) => tracing::warn!(error = %e, "firing schedules failed"),
            }
        }
        if !config.retention.is_empty() && Instant::now() >= next_prune {
            next_prune = Instant::now() + PRUNE_EVERY;
            prune_all(shared, &mut conn, &config.retention);
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
        if Instant::now() >= next_rescue {
            next_rescue = Instant::now() + rescue_every;
            rescued(shared, conn.with(|c| jobs::rescue_lapsed(c, 100)));
        }
        if Instant::now() >= next_expire {
            next_expire = Instant::now() + EXPIRE_EVERY;
            if let Err(e) = conn.with(|c| jobs::expire_parked(c, 100)) {
                tracing::warn!(error = %e, "failing parked jobs past their deadline failed");
            }
        }
        if Instant::now() >= next_dead_workers {
            next_dead_workers = Instant::now() + jobs::registry::DEAD_WORKERS_EVERY;
            rescued(shared, conn.with(|c| jobs::rescue_dead(c, 100)));
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
                tracing::warn!(error = %e, pause = ?error_pause, "claiming failed; backing off");
                let state = shared.lock();
                drop(shared.wait(state, error_pause));
                error_pause = (error_pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Reports what a rescue pass did.
fn rescued(shared: &Shared, outcome: crate::Result<jobs::Rescued>) {
    match outcome {
        Ok(rescued)
            if !(rescued.requeued.is_empty()
                && rescued.dead.is_empty()
                && rescued.cancelled.is_empty()) =>
        {
            shared.emit(Event::Rescued {
                requeued: rescued.requeued.len(),
                dead: rescued.dead.len(),
                cancelled: rescued.cancelled.len(),
            });
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "rescue failed"),
    }
}

/// One pruning pass: every policy, at most `MAX_BATCH` jobs a call, until a call deletes fewer.
fn prune_all(
    shared: &Shared,
    conn: &mut Connection<'_>,
    policies: &[(String, Finished, Retention)],
) {
    for (queue, finished, policy) in policies {
        let mut deleted = 0;
        loop {
            match conn.with(|c| jobs::prune(c, queue, *finished, *policy, jobs::MAX_BATCH)) {
                Ok(n) if n == jobs::MAX_BATCH => deleted += n,
                Ok(n) => {
                    deleted += n;
                    break;
                }
                Err(e) => {
                    tracing::warn!(%queue, error = %e, "pruning failed");
                    break;
                }
            }
        }
        if deleted > 0 {
            shared.emit(Event::Pruned {
                queue: queue.clone(),
                deleted,
            });
        }
    }
}

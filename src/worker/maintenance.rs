//! The maintenance thread: fires schedules, rescues lapsed claims and dead workers' claims,
//! fails parked jobs past their deadline, prunes and turns PostgreSQL's job slots, on a connection of its own outside the
//! pool. (The ready ring's rotation stays on the claimer: `claimer.rs` says why.)
//!
//! Why not on the claimer: these passes read tables whose dead row versions a long
//! transaction keeps (retention's prune walks every finished job deleted since the oldest
//! snapshot began), so one of them can take long while the database is under such a hold,
//! and a claim waiting behind it is a pickup delayed by all of it (bench G's p99). Here they
//! delay only each other, and a busy worker (every thread running a long job, nothing to
//! claim) still rescues and prunes.

use std::time::{Duration, Instant};

use super::runs::Shared;
use crate::events::Event;
use crate::jobs::{self, Finished, Retention, prune_after};
use crate::{AnyConnection, Result};

/// How often a worker that runs schedules fires them.
const SCHEDULES_EVERY: Duration = Duration::from_millis(100);

/// How often a worker fails parked jobs past their deadline ([`jobs::expire_parked`]): a
/// read of the open parks' index by deadline.
const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// How often a worker with retention policies prunes.
const PRUNE_EVERY: Duration = Duration::from_secs(5);

/// How often a worker that ages priorities does so: a quarter of the age, from 250 ms (each
/// pass reads the queue's due entries) to 30 s.
fn aging_every(after: Duration) -> Duration {
    (after / 4).clamp(Duration::from_millis(250), Duration::from_secs(30))
}

/// How long PostgreSQL's new jobs fill one slot of `tenure_jobs` before a rotation may move
/// them on ([`jobs::rotate_job_slots`], tried each second): a slot can be truncated only
/// once retention has deleted every job in it, so it should hold a few seconds of jobs, and
/// six of them should outlast a short retention (bench G's and P's ten seconds).
const SLOT_TURN: Duration = Duration::from_secs(5);

/// The thread's connection, opened when first needed and again after an error (it may be
/// broken: the database restarted).
struct Dedicated<'a> {
    pool: &'a crate::Pool,
    conn: Option<AnyConnection>,
}

impl Dedicated<'_> {
    fn with<T>(&mut self, f: impl FnOnce(&mut AnyConnection) -> Result<T>) -> Result<T> {
        let conn = match self.conn.as_mut() {
            Some(conn) => conn,
            None => self.conn.insert(self.pool.dedicated_connection()?),
        };
        let outcome = f(conn);
        if outcome.is_err() {
            self.conn = None;
        }
        outcome
    }
}

/// When each pass is next due.
struct Due {
    schedules: Instant,
    prune: Instant,
    rescue: Instant,
    expire: Instant,
    dead_workers: Instant,
    aging: Instant,
}

pub(super) fn maintain(shared: &Shared) {
    let config = &shared.config;
    shared.registration.wait_for_first(shared);
    let mut conn = Dedicated {
        pool: &config.pool,
        conn: None,
    };
    let rescue_every = (config.claim_ttl / 2).min(Duration::from_secs(30));
    let now = Instant::now();
    // Dead workers' claims are looked for often (the look is a read of a small table), and
    // first when this worker starts: a worker started in place of one that died takes its
    // jobs back within seconds.
    let mut due = Due {
        schedules: now,
        prune: now,
        rescue: now,
        expire: now,
        dead_workers: now,
        aging: now,
    };
    // When the job slots last turned (PostgreSQL): at start, never.
    let mut last_turn = now.checked_sub(3 * SLOT_TURN).unwrap_or(now);
    let mut prune_turns = Turns::default();
    let mut aging_turns = Turns::default();
    loop {
        {
            let mut state = shared.lock();
            loop {
                if state.stopping {
                    return;
                }
                let next = [
                    config.run_schedules.then_some(due.schedules),
                    (!config.retention.is_empty()).then_some(due.prune),
                    Some(due.rescue),
                    Some(due.expire),
                    Some(due.dead_workers),
                    config.aging.map(|_| due.aging),
                ]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(now);
                let left = next.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                state = shared.wait(state, left);
            }
        }
        if config.run_schedules && Instant::now() >= due.schedules {
            due.schedules = Instant::now() + SCHEDULES_EVERY;
            match conn.with(crate::schedules::tick) {
                Ok(0) => {}
                Ok(enqueued) => shared.emit(Event::SchedulesFired { enqueued }),
                Err(e) => tracing::warn!(error = %e, "firing schedules failed"),
            }
        }
        if Instant::now() >= due.dead_workers {
            due.dead_workers = Instant::now() + jobs::registry::DEAD_WORKERS_EVERY;
            rescued(shared, conn.with(|c| jobs::rescue_dead(c, 100)));
        }
        if Instant::now() >= due.rescue {
            due.rescue = Instant::now() + rescue_every;
            rescued(shared, conn.with(|c| jobs::rescue_lapsed(c, 100)));
        }
        if Instant::now() >= due.expire {
            due.expire = Instant::now() + EXPIRE_EVERY;
            if let Err(e) = conn.with(|c| jobs::expire_parked(c, 100)) {
                tracing::warn!(error = %e, "failing parked jobs past their deadline failed");
            }
            // Whole slots the policies would empty (PostgreSQL), then the turn onto one: what
            // a slot held, the prunes need not delete one by one.
            if !config.retention.is_empty() {
                match conn.with(|c| jobs::reclaim_job_slots(c, &config.retention)) {
                    // Retention's deletes, whole slots at a time: reported as the prunes'.
                    Ok(reclaimed) => {
                        for (queue, deleted) in reclaimed.jobs {
                            shared.emit(Event::Pruned { queue, deleted });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "reclaiming job slots failed"),
                }
            }
            match conn.with(|c| jobs::rotate_job_slots(c, SLOT_TURN)) {
                Ok(Some(_)) => last_turn = Instant::now(),
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "turning the job slots failed"),
            }
        }
        if let Some(after) = config.aging
            && Instant::now() >= due.aging
        {
            due.aging = Instant::now() + aging_every(after);
            if age_all(shared, &mut conn, after, &mut aging_turns) {
                due.aging = Instant::now();
            }
        }
        if !config.retention.is_empty() && Instant::now() >= due.prune {
            due.prune = Instant::now() + PRUNE_EVERY;
            // While the job slots turn, the slots the reclaim will take are left to it.
            let slots_turn = last_turn.elapsed() < 3 * SLOT_TURN;
            if prune_all(
                shared,
                &mut conn,
                &config.retention,
                &mut prune_turns,
                slots_turn,
            ) {
                // The rest at once, after the other passes that are due.
                due.prune = Instant::now();
            }
        }
    }
}

/// Reports what a rescue pass did, and wakes the claimer for the jobs it made due again.
fn rescued(shared: &Shared, outcome: Result<jobs::Rescued>) {
    match outcome {
        Ok(rescued)
            if !(rescued.requeued.is_empty()
                && rescued.dead.is_empty()
                && rescued.cancelled.is_empty()) =>
        {
            if !rescued.requeued.is_empty() {
                shared.lock().woken = true;
                shared.changed.notify_all();
            }
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

/// How many calls of [`jobs::MAX_BATCH`] jobs one pass makes at most, over all its queues
/// or policies, and for how long it starts new ones: a pass that stops there leaves the rest
/// to the next, due at once but after whatever else is due. A pass that went on while
/// batches were full held the thread for as long as a backlog lasted (a finisher faster than
/// the prune keeps every batch full; so do forty policies with ten thousand jobs each, or a
/// queue of a hundred thousand jobs to age): no schedule fired, no lapsed claim was rescued,
/// no job slot turned meanwhile.
const PASS_BATCHES: u32 = 10;
const PASS_TIME: Duration = Duration::from_millis(500);

/// What is left of a pass: calls, and time to start them in.
struct Budget {
    calls: u32,
    until: Instant,
    taken: u32,
}

impl Budget {
    /// Takes one call, if any is left.
    fn take(&mut self) -> bool {
        if self.calls == 0 || Instant::now() >= self.until {
            self.calls = 0;
            return false;
        }
        self.calls -= 1;
        self.taken += 1;
        true
    }
}

/// Whose turn a bounded pass starts with: the queue or policy after the one at which the
/// last pass ran out, so a backlog in one never starves the others.
#[derive(Default)]
struct Turns {
    next: usize,
}

impl Turns {
    /// Gives each item its turn from `self.next`, with what is left of the pass (`each`
    /// takes a call from it before each one). Returns whether the pass ran out, so that
    /// some item may have more.
    fn pass<T>(&mut self, items: &[T], mut each: impl FnMut(&T, &mut Budget)) -> bool {
        let mut budget = Budget {
            calls: PASS_BATCHES,
            until: Instant::now() + PASS_TIME,
            taken: 0,
        };
        for k in 0..items.len() {
            let i = (self.next + k) % items.len();
            let taken = budget.taken;
            each(&items[i], &mut budget);
            if budget.calls == 0 {
                // The next pass starts with this one again if its turn made no call.
                self.next = if budget.taken == taken {
                    i
                } else {
                    (i + 1) % items.len()
                };
                return true;
            }
        }
        false
    }
}

/// One aging pass over the worker's queues in turn, `MAX_BATCH` jobs a call, each queue until
/// a call reads fewer, within [`PASS_BATCHES`] and [`PASS_TIME`]. Returns whether it ran out.
fn age_all(shared: &Shared, conn: &mut Dedicated<'_>, after: Duration, turns: &mut Turns) -> bool {
    // Validated when the worker was built.
    let after = i64::try_from(after.as_micros()).unwrap_or(i64::MAX);
    turns.pass(&shared.config.queues, |queue, budget| {
        let mut aged = 0;
        while budget.take() {
            // Again while a call read a full batch (it may have moved fewer: claims took some).
            match conn.with(|c| jobs::age_batch(c, queue, after, jobs::MAX_BATCH as i64)) {
                Ok((read, moved)) if read == jobs::MAX_BATCH && !shared.stopping() => aged += moved,
                Ok((_, moved)) => {
                    aged += moved;
                    break;
                }
                Err(e) => {
                    tracing::warn!(%queue, error = %e, "aging priorities failed");
                    break;
                }
            }
        }
        if aged > 0 {
            shared.emit(Event::Aged {
                queue: queue.clone(),
                jobs: aged,
            });
        }
    })
}

/// One pruning pass over the policies in turn, `MAX_BATCH` jobs a call, each until a call
/// deletes fewer, within [`PASS_BATCHES`] and [`PASS_TIME`]. Returns whether it ran out. Each
/// policy's turn starts from its first job, so one whose position moved past a job (a dedup
/// window closed since, a job that committed with an older finish time) comes back for it in
/// the next.
/// While the job slots turn (`slots_turn`, PostgreSQL), only `kept` and the oldest slots: the
/// reclaim takes the newest whole, without a dead row version a job.
fn prune_all(
    shared: &Shared,
    conn: &mut Dedicated<'_>,
    policies: &[(String, Finished, Retention)],
    turns: &mut Turns,
    slots_turn: bool,
) -> bool {
    turns.pass(policies, |(queue, finished, policy), budget| {
        let mut deleted = 0;
        // Each batch after the last one's position (`retention::prune_after`).
        let mut reached = None;
        while budget.take() {
            let outcome = conn.with(|c| {
                let batch = jobs::MAX_BATCH;
                prune_after(c, queue, *finished, *policy, batch, reached, slots_turn)
            });
            match outcome {
                Ok((n, at)) if n == jobs::MAX_BATCH && !shared.stopping() => {
                    deleted += n;
                    reached = at;
                }
                Ok((n, _)) => {
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
    })
}

//! A guard's renewal thread and the state it shares with the guard: renews the lease every
//! ttl/3, checks the holder's liveness lock every second (fast takeover), keeps the local
//! deadline after which the lease counts as lost, and releases once stopped.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant as Clock};

use super::Lease;
use super::liveness::{ALIVE_FOR, HOLDER_CHECK, HolderLock};
use crate::{Pool, PooledConnection, Result, TenureConnection};

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
}

pub(super) struct State {
    /// The lease's name, for the log.
    pub(super) name: String,
    /// Local monotonic instant after which the lease counts as lost, by its renewals.
    pub(super) renewed_until: Clock,
    /// The same by the checks of its liveness lock (fast takeover), if it must check one.
    pub(super) alive_until: Option<Clock>,
    pub(super) lost: bool,
    pub(super) stop: bool,
    /// Whether the renewal thread releases the lease once stopped (not when the caller
    /// releases it on a connection of its own).
    pub(super) release: bool,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves plain data; keep going.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// The local monotonic instant after which the lease counts as lost.
    /// Moves the liveness deadline (fast takeover) later, if the guard has one.
    fn extend_alive(&mut self, until: Clock) {
        if let Some(alive) = self.alive_until.as_mut() {
            *alive = (*alive).max(until);
        }
    }

    pub(super) fn deadline(&self) -> Clock {
        self.alive_until
            .map_or(self.renewed_until, |alive| alive.min(self.renewed_until))
    }

    /// Marks the lease lost once the deadline has passed; loss is sticky.
    pub(super) fn check_deadline(&mut self, now: Clock) -> bool {
        if now >= self.deadline() && !self.lost {
            self.lost = true;
            tracing::warn!(
                target: "tenure::lease",
                lease = %self.name,
                reason = "no renewal (or check of its liveness lock) succeeded before the local deadline",
                "lease lost"
            );
        }
        self.lost
    }

    fn lose(&mut self, name: &str, reason: &str) {
        if !self.lost {
            tracing::warn!(target: "tenure::lease", lease = %name, reason, "lease lost");
        }
        self.lost = true;
    }
}

/// Where a guard gets a fresh connection after a failed renewal.
pub(super) type Reconnect<C> = Box<dyn Fn() -> Result<C> + Send>;

pub(super) fn reconnect(pool: &Pool) -> Reconnect<PooledConnection> {
    let pool = pool.clone();
    Box::new(move || pool.get())
}

/// Releases `lease`, trying again after transient errors (a busy SQLite, a lock timeout)
/// until the local `deadline`, after which the lease lapses anyway; after another error, once
/// more on a fresh connection (the connection may have broken since the last renewal).
fn release_until<C: TenureConnection>(
    conn: &mut C,
    reconnect: Option<&Reconnect<C>>,
    lease: &mut Lease,
    deadline: Clock,
) -> Result<bool> {
    let mut reconnected = false;
    loop {
        let error = match lease.release(conn) {
            Ok(released) => return Ok(released),
            Err(e) => e,
        };
        if error.is_retryable() {
            if Clock::now() >= deadline {
                return Err(error);
            }
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        match reconnect {
            Some(get) if !reconnected => {
                *conn = get()?;
                reconnected = true;
            }
            _ => return Err(error),
        }
    }
}

/// The safety margin under the ttl for the local deadline.
pub(super) fn margin(ttl: Duration) -> Duration {
    ttl / 10
}

/// What the renewal thread holds: the lease, where it renews it, and its liveness lock.
pub(super) struct Renewal<C> {
    pub(super) conn: C,
    pub(super) reconnect: Option<Reconnect<C>>,
    pub(super) lease: Lease,
    pub(super) ttl: Duration,
    /// Its liveness lock, if any (checked if a session lock); dropped after the release.
    pub(super) holder_lock: Option<HolderLock>,
    /// Whether a renewal succeeded since the liveness lock was last taken (the grant counts):
    /// only then does a check that finds it held extend the deadline.
    pub(super) renewed_since_lock: bool,
}

impl<C: TenureConnection> Renewal<C> {
    /// Renews every ttl/3 (and checks the liveness lock every [`HOLDER_CHECK`]) until
    /// stopped or lost, then releases (after the last renewal, never before).
    pub(super) fn until_stopped(&mut self, shared: &Shared) -> Result<bool> {
        let period = self.ttl / 3;
        let mut next = Clock::now() + period;
        let mut next_check = Clock::now() + HOLDER_CHECK;
        loop {
            {
                let mut state = shared.lock();
                loop {
                    if state.stop {
                        let (release, deadline) = (state.release, state.deadline());
                        drop(state);
                        if !release {
                            return Ok(false);
                        }
                        let released = release_until(
                            &mut self.conn,
                            self.reconnect.as_ref(),
                            &mut self.lease,
                            deadline,
                        );
                        // Released (or no longer ours): no grant records its key as held.
                        if released.is_ok() {
                            if let Some(lock) = self.holder_lock.take() {
                                lock.keep_for_reuse();
                            }
                        }
                        return released;
                    }
                    let now = Clock::now();
                    let lost = state.check_deadline(now);
                    let checks = self
                        .holder_lock
                        .as_ref()
                        .is_some_and(HolderLock::needs_checks);
                    if !lost && (now >= next || (checks && now >= next_check)) {
                        break;
                    }
                    // Lost: renew no more, just wait to be stopped.
                    let wake = if lost {
                        Duration::from_secs(3600)
                    } else if checks {
                        next.min(next_check).min(state.deadline()) - now
                    } else {
                        next.min(state.deadline()) - now
                    };
                    state = shared
                        .changed
                        .wait_timeout(state, wake)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
            shared.changed.notify_all();
            let sent = Clock::now();
            let check_due = sent >= next_check;
            if let Some(lock) = self
                .holder_lock
                .as_mut()
                .filter(|l| check_due && l.needs_checks())
            {
                let held = lock.check();
                // Lost (its session ended, or its connection broke): taken again on a new
                // connection, and renewed at once, which undoes any grant's shortening.
                let relocked = !matches!(held, Ok(true))
                    && {
                        match lock.take_again() {
                            Ok(taken) => taken,
                            Err(e) => {
                                tracing::debug!(lease = %self.lease.name, error = %e, "taking a lease's liveness lock again failed");
                                false
                            }
                        }
                    };
                let mut state = shared.lock();
                match held {
                    // Held since a renewal: no look since found it free.
                    Ok(true) if self.renewed_since_lock && !state.lost => {
                        state.extend_alive(sent + ALIVE_FOR);
                    }
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(lease = %self.lease.name, relocked, "the session holding the lease's liveness lock ended")
                    }
                    Err(e) => {
                        tracing::warn!(lease = %self.lease.name, error = %e, relocked, "checking a lease's liveness lock failed")
                    }
                }
                if relocked {
                    self.renewed_since_lock = false;
                    next = sent;
                }
                next_check = sent + HOLDER_CHECK;
                drop(state);
                shared.changed.notify_all();
                continue;
            }
            let outcome = self.lease.renew(&mut self.conn, self.ttl);
            let mut state = shared.lock();
            match outcome {
                Ok(()) if !state.lost => {
                    state.renewed_until = sent + self.ttl - margin(self.ttl);
                    // Any grant's shortening before this renewal is undone; a later one
                    // lapses after sent + TAKEOVER_AFTER.
                    state.extend_alive(sent + ALIVE_FOR);
                    self.renewed_since_lock = true;
                    next = sent + period;
                }
                Ok(()) => {}
                Err(e) if e.is_lease_lost() => state.lose(
                    &self.lease.name,
                    "the database gave it to another holder or it was released",
                ),
                Err(e) => {
                    // Unreachable or busy: try again soon (within a second: a liveness
                    // deadline may be near); the deadline stands.
                    tracing::warn!(lease = %self.lease.name, error = %e, "renewing a lease failed; retrying");
                    next = Clock::now()
                        + (period / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
                    drop(state);
                    // The connection may be broken (the database restarted): use a fresh one.
                    if let Some(fresh) = self.reconnect.as_ref().and_then(|get| get().ok()) {
                        self.conn = fresh;
                    }
                    shared.changed.notify_all();
                    continue;
                }
            }
            drop(state);
            shared.changed.notify_all();
        }
    }
}

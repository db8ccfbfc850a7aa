//! A guard's threads and the state they share with the guard: the renewal thread renews the
//! lease every ttl/3 and releases it once stopped; the check thread (fast takeover, on a
//! server) checks the holder's liveness lock every second and takes it again when its session
//! ended. Together they keep the local deadline after which the lease counts as lost. A check
//! that hangs (a connection that stopped answering) never holds up a renewal or the release.

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
    /// When the liveness lock's current session took it, if it was taken again since the
    /// grant (the check thread).
    pub(super) lock_taken_at: Option<Clock>,
    /// Whether a renewal was sent (and succeeded) after the liveness lock's current session
    /// took it (the grant counts): only then does a check that finds it held extend the
    /// deadline.
    pub(super) renewed_since_lock: bool,
    /// The check thread took the lock again: renew at once (which undoes any grant's
    /// shortening made while it was free).
    pub(super) renew_now: bool,
    /// The renewal thread's final release: `Some(true)` once it released the lease or found
    /// it no longer the guard's (the check thread may then keep its lock for reuse).
    pub(super) released_cleanly: Option<bool>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves plain data; keep going.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// A new guard's state: it holds its lease until `renewed_until`, and, if `alive_until`,
    /// until then by its liveness lock.
    pub(super) fn new(name: &str, renewed_until: Clock, alive_until: Option<Clock>) -> State {
        State {
            name: name.to_owned(),
            renewed_until,
            alive_until,
            lost: false,
            stop: false,
            release: true,
            lock_taken_at: None,
            renewed_since_lock: true,
            renew_now: false,
            released_cleanly: None,
        }
    }

    /// Moves the liveness deadline (fast takeover) later, if the guard has one.
    fn extend_alive(&mut self, until: Clock) {
        if let Some(alive) = self.alive_until.as_mut() {
            *alive = (*alive).max(until);
        }
    }

    /// The local monotonic instant after which the lease counts as lost.
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

/// What the renewal thread holds: the lease and where it renews it.
pub(super) struct Renewal<C> {
    pub(super) conn: C,
    pub(super) reconnect: Option<Reconnect<C>>,
    pub(super) lease: Lease,
    pub(super) ttl: Duration,
}

impl<C: TenureConnection> Renewal<C> {
    /// Renews every ttl/3 (at once when the check thread took the liveness lock again) until
    /// stopped or lost, then releases (after the last renewal, never before).
    pub(super) fn until_stopped(&mut self, shared: &Shared) -> Result<bool> {
        let period = self.ttl / 3;
        let mut next = Clock::now() + period;
        loop {
            {
                let mut state = shared.lock();
                loop {
                    if state.stop {
                        let (release, deadline) = (state.release, state.deadline());
                        drop(state);
                        if !release {
                            self.finished(shared, false);
                            return Ok(false);
                        }
                        let released = release_until(
                            &mut self.conn,
                            self.reconnect.as_ref(),
                            &mut self.lease,
                            deadline,
                        );
                        self.finished(shared, released.is_ok());
                        return released;
                    }
                    let now = Clock::now();
                    let lost = state.check_deadline(now);
                    if !lost && (now >= next || state.renew_now) {
                        state.renew_now = false;
                        break;
                    }
                    // Lost: renew no more, just wait to be stopped.
                    let wake = if lost {
                        Duration::from_secs(3600)
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
            let outcome = self.lease.renew(&mut self.conn, self.ttl);
            let mut state = shared.lock();
            match outcome {
                Ok(()) if !state.lost => {
                    state.renewed_until = sent + self.ttl - margin(self.ttl);
                    // Any grant's shortening before this renewal is undone; a later one
                    // lapses after sent + TAKEOVER_AFTER.
                    state.extend_alive(sent + ALIVE_FOR);
                    if state.lock_taken_at.is_none_or(|taken| sent > taken) {
                        state.renewed_since_lock = true;
                    }
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

    /// Says how the release ended, for the check thread.
    fn finished(&mut self, shared: &Shared, cleanly: bool) {
        shared.lock().released_cleanly = Some(cleanly);
        shared.changed.notify_all();
    }
}

/// The check thread (a session lock, on a server): every [`HOLDER_CHECK`] (counted from the
/// end of the previous check), whether the lock's session still holds it; if not, takes it
/// again on a new connection and has the renewal thread renew at once. A check that found it
/// held by a session that has held it since a renewal moves the liveness deadline. Once the
/// guard stops: the lock goes back to its pool for the next guard if the lease was released
/// cleanly, else it is dropped.
pub(super) fn check_until_stopped(mut lock: HolderLock, shared: &Shared) {
    let mut next = Clock::now() + HOLDER_CHECK;
    loop {
        {
            let mut state = shared.lock();
            loop {
                if state.stop {
                    // The release's outcome (the renewal thread says it, bounded: a release
                    // waits at most until the lease's deadline).
                    let until = Clock::now() + Duration::from_secs(60);
                    while state.released_cleanly.is_none() && Clock::now() < until {
                        state = shared
                            .changed
                            .wait_timeout(state, Duration::from_millis(100))
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    if state.released_cleanly == Some(true) {
                        drop(state);
                        lock.keep_for_reuse();
                    }
                    return;
                }
                let now = Clock::now();
                if now >= next && !state.lost {
                    break;
                }
                let wake = if state.lost {
                    Duration::from_secs(3600)
                } else {
                    next - now
                };
                state = shared
                    .changed
                    .wait_timeout(state, wake)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        let sent = Clock::now();
        let held = lock.check();
        // Lost (its session ended, or its connection broke): taken again on a new
        // connection, and renewed at once.
        let relocked = !matches!(held, Ok(true))
            && match lock.take_again() {
                Ok(taken) => taken,
                Err(e) => {
                    tracing::debug!(lease = %shared.lock().name, error = %e, "taking a lease's liveness lock again failed");
                    false
                }
            };
        let mut state = shared.lock();
        match held {
            // Held since a renewal: any look since found it held.
            Ok(true) if state.renewed_since_lock && !state.lost => {
                state.extend_alive(sent + ALIVE_FOR);
            }
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(lease = %state.name, relocked, "the session holding the lease's liveness lock ended")
            }
            Err(e) => {
                tracing::warn!(lease = %state.name, error = %e, relocked, "checking a lease's liveness lock failed")
            }
        }
        if relocked {
            state.lock_taken_at = Some(Clock::now());
            state.renewed_since_lock = false;
            state.renew_now = true;
        }
        drop(state);
        shared.changed.notify_all();
        next = Clock::now() + HOLDER_CHECK;
    }
}

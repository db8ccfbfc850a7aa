//! The worker's registration (`tenure_workers`) and the lock that says it lives (see
//! `jobs::queue::rescue` for how a dead worker is recognised). The worker registers when it starts;
//! this thread keeps the lock: on a server, on a connection of its own outside the pool,
//! checked every [`WORKER_BEAT`] and taken again on a new connection when its session ended
//! (a server restart, a killed connection); on SQLite, an open file. The heartbeat thread
//! writes the heartbeat (through its pooled connection, so that a lost lock connection does
//! not stop it). At shutdown the worker's row is deleted and the lock released.
//!
//! The first registration is made by this thread, not by `start`, which never waits for the
//! database; the claimer waits for it instead, so that every claim records the worker (a
//! worker that dies in its first seconds is recognised as well).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::runs::Shared;
use crate::backend::LivenessLock;
use crate::jobs::registry::{self, Registered, Relocked, WORKER_BEAT};
use crate::{AnyConnection, Backend, Pool, Result};

/// The worker's current registration, as the claimer (which records it in its claims) and
/// the heartbeat (which writes its heartbeat) read it.
#[derive(Debug, Default)]
pub(super) struct Current {
    /// The id, 0 while unregistered (ids start at 1).
    id: AtomicI64,
    /// Set by the heartbeat when the row is gone: a rescue took the worker for dead.
    gone: AtomicBool,
    /// The first registration was tried (made or failed): the claimer waits for it, so that
    /// the worker's first claims record it.
    tried: AtomicBool,
}

impl Current {
    /// Waits until the first registration was tried, or the worker stops.
    pub fn wait_for_first(&self, shared: &Shared) {
        while !self.tried.load(Ordering::SeqCst) {
            let state = shared.lock();
            if state.stopping {
                return;
            }
            drop(shared.wait(state, Duration::from_millis(20)));
        }
    }

    pub fn id(&self) -> Option<i64> {
        let id = self.id.load(Ordering::SeqCst);
        (id != 0).then_some(id)
    }

    fn set(&self, id: Option<i64>) {
        self.gone.store(false, Ordering::SeqCst);
        self.id.store(id.unwrap_or(0), Ordering::SeqCst);
    }

    /// The heartbeat found worker `id`'s row gone.
    pub fn gone(&self, id: i64) {
        if self.id() == Some(id) {
            self.gone.store(true, Ordering::SeqCst);
        }
    }

    fn take_gone(&self) -> bool {
        self.gone.swap(false, Ordering::SeqCst)
    }
}

/// A registration, and what holds its lock.
struct Registration {
    registered: Registered,
    /// On a server: the connection whose session holds the lock (`None` while it is lost).
    conn: Option<AnyConnection>,
}

impl Registration {
    fn id(&self) -> i64 {
        self.registered.id
    }
}

/// Registers a worker of this process: its row and its lock, on a connection of its own
/// (servers) or in its lock file (SQLite).
fn register(pool: &Pool, current: &Current) -> Result<Registration> {
    let host = host();
    let registration = if pool.backend() == Backend::Sqlite {
        let registered = registry::register(&mut pool.get()?, &host)?;
        Registration {
            registered,
            conn: None,
        }
    } else {
        let mut conn = pool.dedicated_connection()?;
        let registered = registry::register(&mut conn, &host)?;
        Registration {
            registered,
            conn: Some(conn),
        }
    };
    current.set(Some(registration.id()));
    tracing::debug!(target: "tenure::worker", worker = registration.id(), "registered");
    Ok(registration)
}

/// The liveness thread: registers the worker (as it starts: its first claims wait for it),
/// keeps the registration (or makes one) until `stop` says to stop, then unregisters.
pub(super) fn keep_alive(shared: &Shared, stop: Receiver<()>) {
    let pool = &shared.config.pool;
    let current = &shared.registration;
    let mut registration = match register(pool, current) {
        Ok(made) => Some(made),
        Err(e) => {
            tracing::warn!(target: "tenure::worker", error = %e, "cannot register this worker yet; its claims are protected by their ttl alone until it can");
            None
        }
    };
    current.tried.store(true, Ordering::SeqCst);
    shared.changed.notify_all();
    // Warnings about a registration that keeps failing, at most every minute.
    let mut next_warning = Instant::now() + Duration::from_secs(60);
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(WORKER_BEAT) {
        if current.take_gone() {
            if let Some(gone) = registration.take() {
                tracing::warn!(
                    target: "tenure::worker",
                    worker = gone.id(),
                    "this worker was taken for dead (it could not reach the database for a while): registering again; the claims it holds keep their ttl"
                );
            }
            current.set(None);
        }
        match registration.as_mut() {
            Some(held) => keep(pool, current, held),
            None => match register(pool, current) {
                Ok(made) => registration = Some(made),
                Err(e) => {
                    if Instant::now() >= next_warning {
                        tracing::warn!(target: "tenure::worker", error = %e, "cannot register this worker; its claims are protected by their ttl alone until it can");
                        next_warning = Instant::now() + Duration::from_secs(60);
                    }
                }
            },
        }
    }
    if let Some(registration) = registration {
        current.set(None);
        leave(pool, registration);
    }
}

/// Checks that the lock connection's session still holds the lock; if not, takes it again on
/// a new connection.
fn keep(pool: &Pool, current: &Current, held: &mut Registration) {
    if !matches!(held.registered.lock, LivenessLock::Session) {
        // A file lock (or none) cannot be lost.
        return;
    }
    let id = held.id();
    let lost = match held.conn.as_mut() {
        // Lost before, not taken again yet.
        None => true,
        Some(conn) => match registry::holds_lock(conn, id) {
            Ok(true) => false,
            Ok(false) => {
                tracing::warn!(target: "tenure::worker", worker = id, "the worker's lock connection no longer holds its lock; taking it again");
                true
            }
            Err(e) => {
                tracing::warn!(target: "tenure::worker", worker = id, error = %e, "the worker's lock connection was lost; taking its lock again");
                true
            }
        },
    };
    if lost {
        held.conn = None;
        take_again(pool, current, held);
    }
}

fn take_again(pool: &Pool, current: &Current, held: &mut Registration) {
    let id = held.id();
    let mut conn = match pool.dedicated_connection() {
        Ok(conn) => conn,
        Err(e) => {
            tracing::debug!(target: "tenure::worker", worker = id, error = %e, "cannot connect to take the worker's lock again");
            return;
        }
    };
    match registry::relock(&mut conn, id) {
        Ok(Relocked::Held) => {
            tracing::info!(target: "tenure::worker", worker = id, "took the worker's lock again");
            held.conn = Some(conn);
        }
        // Its old session has not ended on the server yet, or a rescue is looking at it.
        Ok(Relocked::Busy) => {}
        Ok(Relocked::Gone) => current.gone(id),
        Err(e) => {
            tracing::debug!(target: "tenure::worker", worker = id, error = %e, "taking the worker's lock again failed")
        }
    }
}

/// At shutdown: the row goes (the claims still held keep only their ttl), then the lock.
fn leave(pool: &Pool, registration: Registration) {
    let id = registration.id();
    let Registration {
        registered,
        mut conn,
    } = registration;
    let left = match conn.as_mut() {
        Some(conn) => registry::unregister(conn, id),
        None => pool
            .get()
            .and_then(|mut conn| registry::unregister(&mut conn, id)),
    };
    match left {
        Ok(()) => {
            // Closing the connection ends its session, and the lock with it.
            drop(conn);
            if let LivenessLock::File(file) = registered.lock {
                file.remove();
            }
        }
        Err(e) => {
            // The claims it still holds (runs still in their handlers) may be run by this
            // process yet: the lock stays held until the process exits, then they are
            // rescued.
            tracing::warn!(target: "tenure::worker", worker = id, error = %e, "unregistering the worker failed; its lock is kept until the process exits");
            std::mem::forget(conn);
            std::mem::forget(registered);
        }
    }
}

/// This host's name, as a label (for people reading `tenure_workers`).
fn host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let mut name: String = name.trim().chars().filter(|c| *c != '\0').collect();
    let mut end = name.len().min(crate::MAX_LABEL_BYTES);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

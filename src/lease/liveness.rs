//! Fast takeover: a lease holder's process says it lives by a lock that ends with it, so a
//! holder that died loses its grant within seconds instead of at the end of its ttl.
//!
//! A guard taken from a pool first takes a **holder lock** under a random key (on
//! PostgreSQL and MySQL/MariaDB a session lock on a connection of its own, outside the pool;
//! on SQLite an exclusive `flock` of a file beside the database, as a worker's lock is), and
//! its grant records the key (`tenure_leases.held_by`). A grant that finds a held slot whose
//! holder lock is free (inside its own transaction, under the slot's row lock) shortens that
//! grant: it now lapses [`TAKEOVER_AFTER`] after that look (at once on SQLite), unless
//! sooner, with no lock delay. A renewal of the holder's undoes it.
//!
//! Why the holder always knows first. On a server a session can end while its process lives
//! (its connection cut, a server restart, a failover): the guard checks its lock every
//! [`HOLDER_CHECK`] and takes it again on a new connection when it lost it, then renews at
//! once. A grant that shortened the lease lapses [`TAKEOVER_AFTER`] after a look that found
//! the lock free, and so after every renewal that committed before that look (a later one
//! undoes the shortening). The guard counts its lease as lost [`ALIVE_FOR`] (less than
//! [`TAKEOVER_AFTER`]) after the later of: the last renewal that succeeded, and the last check
//! that found the lock held *by a session that has held it since a successful renewal* (a
//! look in between found it held too, so any look that finds it free comes later). A lock
//! taken again counts only from the renewal that follows it. On SQLite the lock is freed only
//! when the holder's process ends (every process of the file is on one host), so the lapse is
//! immediate.
//!
//! The price of knowing first: a guard that can reach neither its lock nor its lease for
//! [`ALIVE_FOR`] (a database outage, a stall of the process's threads) counts its lease as
//! lost, where without fast takeover it would keep it up to its ttl. A paused or slow holder
//! (SIGSTOP, a machine at load 10) keeps its session and its lock: nobody takes its grant over
//! before its ttl. A process that died without its sessions ending (its host lost power: the
//! server sees the connections only when their keepalive fails) keeps the grant until its ttl
//! too.

use std::time::Duration;

use crate::backend::{Liveness, LivenessLock, LockSpace, dispatch};
use crate::{AnyConnection, Backend, Error, Pool, Result};

/// How long after a grant finds its holder's lock free (on a server) that grant lapses. The
/// holder counts its lease as lost before then (see the module's documentation).
pub(crate) const TAKEOVER_AFTER: Duration = Duration::from_secs(10);

/// How often a guard checks that its session still holds its holder lock.
pub(super) const HOLDER_CHECK: Duration = Duration::from_secs(1);

/// How much earlier than [`TAKEOVER_AFTER`] after its last good check a guard gives up: for
/// the difference between the database's clock rate and this machine's, with room to spare.
const CHECK_MARGIN: Duration = Duration::from_secs(2);

/// How long a guard may count on its lease after a renewal that succeeded, or a check that
/// found its lock held since one, from the local instant it was sent. So a guard whose
/// checks and renewals all stall or fail for up to about seven seconds keeps its lease.
pub(super) const ALIVE_FOR: Duration = TAKEOVER_AFTER.saturating_sub(CHECK_MARGIN);

/// A lease holder's liveness lock, held until dropped.
#[derive(Debug)]
pub(crate) struct HolderLock {
    key: i64,
    lock: Option<LivenessLock>,
    /// On a server: the connection whose session holds the lock (`None` while lost).
    conn: Option<AnyConnection>,
    /// Where a lost session lock is taken again, and where it is kept for the next guard.
    pool: Pool,
}

/// A random key below 2^31, never 0 (PostgreSQL's advisory lock keeps 32 bits of it).
fn random_key() -> i64 {
    let bits = uuid::Uuid::new_v4().as_u128() as u32 & 0x7fff_ffff;
    i64::from(bits.max(1))
}

impl HolderLock {
    /// Takes a holder lock: one a guard of this pool gave back ([`HolderLock::keep_for_reuse`]:
    /// taking a new one costs a connection, about 4.5 ms on PostgreSQL here), else one under
    /// a fresh key. `None` where nothing can tell a process's death (an SQLite database in
    /// memory, a platform without `flock`, or a lock file that cannot be made: a warning
    /// says so).
    pub(crate) fn take(pool: &Pool) -> Result<Option<HolderLock>> {
        while let Some((key, conn)) = pool.take_spare() {
            let mut spare = HolderLock {
                key,
                lock: Some(LivenessLock::Session),
                conn: Some(conn),
                pool: pool.clone(),
            };
            // Its session may have ended while it was kept (a restart).
            if matches!(spare.check(), Ok(true)) {
                return Ok(Some(spare));
            }
        }
        // A key another holder has is refused: draw again (two in four billion).
        for _ in 0..8 {
            let key = random_key();
            let (lock, conn) = if pool.backend() == Backend::Sqlite {
                let mut conn = pool.get()?;
                let lock =
                    dispatch!(&mut conn, c => c.take_liveness_lock(LockSpace::LeaseHolder, key));
                match lock {
                    Err(Error::LockFile { path, source }) => {
                        tracing::warn!(target: "tenure::lease", path = %path.display(), error = %source, "cannot make a lease holder's lock file: no fast takeover for this lease (its ttl alone ends it)");
                        return Ok(None);
                    }
                    lock => (lock?, None),
                }
            } else {
                let mut conn = pool.dedicated_connection()?;
                let lock =
                    dispatch!(&mut conn, c => c.take_liveness_lock(LockSpace::LeaseHolder, key))?;
                (lock, Some(conn))
            };
            match lock {
                None => continue,
                Some(LivenessLock::Nowhere) => return Ok(None),
                Some(lock) => {
                    return Ok(Some(HolderLock {
                        key,
                        lock: Some(lock),
                        conn,
                        pool: pool.clone(),
                    }));
                }
            }
        }
        Err(Error::invalid(
            "lease holder lock",
            "eight random keys in a row were taken",
        ))
    }

    /// Gives a session lock whose guard released its lease back to its pool, for the next
    /// guard (up to eight are kept, closed when the pool goes); anything else is dropped. Its
    /// key stays this process's: a grant that still records it (one whose release did not
    /// land) lapses at its ttl.
    pub(super) fn keep_for_reuse(mut self) {
        if matches!(self.lock, Some(LivenessLock::Session)) {
            if let Some(conn) = self.conn.take() {
                self.pool.keep_spare(self.key, conn);
            }
        }
    }

    /// The key the grant records (`tenure_leases.held_by`).
    pub(crate) fn key(&self) -> i64 {
        self.key
    }

    /// Whether it can be lost while this process lives (a session lock), so that the guard
    /// must check it.
    pub(super) fn needs_checks(&self) -> bool {
        matches!(self.lock, Some(LivenessLock::Session))
    }

    /// Whether this process holds it now. After `Ok(false)` or an error (its session ended,
    /// or its connection broke), [`HolderLock::take_again`].
    pub(crate) fn check(&mut self) -> Result<bool> {
        match (&self.lock, self.conn.as_mut()) {
            (Some(LivenessLock::Session), Some(conn)) => {
                let key = self.key;
                let held = dispatch!(conn, c => c.holds_liveness_lock(LockSpace::LeaseHolder, key));
                if !matches!(held, Ok(true)) {
                    self.conn = None;
                }
                held
            }
            (Some(LivenessLock::Session), None) => Ok(false),
            // A lock file is held until the process ends.
            _ => Ok(true),
        }
    }

    /// Takes a lost session lock again, on a new connection: `Ok(false)` while its old
    /// session has not ended on the server yet.
    pub(super) fn take_again(&mut self) -> Result<bool> {
        let mut conn = self.pool.dedicated_connection()?;
        let key = self.key;
        match dispatch!(&mut conn, c => c.take_liveness_lock(LockSpace::LeaseHolder, key))? {
            Some(_) => {
                self.conn = Some(conn);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

impl Drop for HolderLock {
    fn drop(&mut self) {
        // A session lock goes with its connection's session, closed here.
        if let Some(LivenessLock::File(file)) = self.lock.take() {
            file.remove();
        }
    }
}

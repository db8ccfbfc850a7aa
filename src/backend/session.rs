//! The settings tenure applies to each connection it opens ([`SessionSetup`]), per backend:
//! below the pool, which applies them to every connection it hands out.

use std::time::Duration;

use super::{Dialect, dispatch};
use crate::{Result, TenureConnection};

/// How SQLite flushes commits to disk (`PRAGMA synchronous`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// Every commit is on disk before it returns: a committed claim or completion survives a
    /// power cut. tenure's default.
    #[default]
    Full,
    /// With WAL, a commit survives a crash of the process but the last commits may be lost on
    /// a power cut or OS crash. Faster; the database stays consistent either way.
    Normal,
}

/// The settings tenure applies to every connection it opens, and that you can apply to your own
/// (with [`SessionSetup::apply`], or as an r2d2 connection customizer on your own pool).
///
/// - SQLite: `busy_timeout` (set first), `journal_mode = WAL`, `synchronous` (FULL by
///   default), `foreign_keys = ON`.
/// - MySQL/MariaDB: session time zone UTC and strict SQL mode (over-long values are errors,
///   never truncated).
/// - PostgreSQL: JIT compilation off (`jit`: compiling took hundreds of milliseconds for
///   statements that run in one, where estimates over `tenure_jobs`' partitions are high).
///
/// tenure's operations are correct without these settings (they never depend on the session
/// time zone, and choose their own isolation), but SQLite without a busy timeout turns every
/// concurrent write into an immediate `SQLITE_BUSY` error.
///
/// [`AnyConnection::connect`](crate::AnyConnection::connect) applies the defaults too; for other settings, start from
/// [`AnyConnection::connect_raw`](crate::AnyConnection::connect_raw):
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// let mut conn = tenure::AnyConnection::connect_raw(":memory:")?;
/// tenure::SessionSetup::default().synchronous(tenure::Synchronous::Normal).apply(&mut conn)?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SessionSetup {
    pub(crate) busy_timeout: Duration,
    pub(crate) synchronous: Synchronous,
}

impl Default for SessionSetup {
    fn default() -> Self {
        SessionSetup {
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Full,
        }
    }
}

impl SessionSetup {
    /// How long an SQLite connection waits for another one's write lock before `SQLITE_BUSY`
    /// (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// SQLite's durability (default [`Synchronous::Full`]).
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Applies the settings to one connection.
    pub fn apply<C: TenureConnection>(&self, conn: &mut C) -> Result<()> {
        Ok(dispatch!(conn, c => c.setup_session(self))?)
    }
}

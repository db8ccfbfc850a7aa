//! A connection pool opened from a URL, with each backend's per-connection settings.

use std::fmt;
use std::time::Duration;

use crate::backend::{Dialect, SessionSetup, dispatch};
use crate::{AnyConnection, Backend, Error, Result, TenureConnection};

impl<C: TenureConnection + 'static> r2d2::CustomizeConnection<C, Error> for SessionSetup {
    fn on_acquire(&self, conn: &mut C) -> Result<()> {
        self.apply(conn)
    }
}

/// For pools built on diesel's own `r2d2::ConnectionManager`.
impl<C: TenureConnection + 'static> r2d2::CustomizeConnection<C, diesel::r2d2::Error>
    for SessionSetup
{
    fn on_acquire(&self, conn: &mut C) -> std::result::Result<(), diesel::r2d2::Error> {
        dispatch!(conn, c => c.setup_session(self)).map_err(diesel::r2d2::Error::QueryError)
    }
}

/// The r2d2 connection manager behind [`Pool`]: it connects with
/// [`AnyConnection::connect_raw`] (the pool applies its own [`SessionSetup`]), so a failure
/// carries the server's own error. Its `Debug` never shows the URL.
pub struct ConnectionManager {
    url: String,
}

impl fmt::Debug for ConnectionManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionManager").finish_non_exhaustive()
    }
}

impl r2d2::ManageConnection for ConnectionManager {
    type Connection = AnyConnection;
    type Error = Error;

    fn connect(&self) -> Result<AnyConnection> {
        AnyConnection::connect_raw(&self.url)
    }

    fn is_valid(&self, conn: &mut AnyConnection) -> Result<()> {
        Ok(diesel::r2d2::R2D2Connection::ping(conn)?)
    }

    fn has_broken(&self, conn: &mut AnyConnection) -> bool {
        diesel::r2d2::R2D2Connection::is_broken(conn)
    }
}

/// A connection checked out of a [`Pool`]. It derefs to [`AnyConnection`] and is itself a
/// [`TenureConnection`].
pub type PooledConnection = r2d2::PooledConnection<ConnectionManager>;

/// An r2d2 pool of [`AnyConnection`]s with tenure's [`SessionSetup`] on each.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("app.db").display().to_string();
/// let pool = tenure::Pool::open(&url)?;
/// let mut conn = pool.get()?;
/// tenure::run_migrations(&mut conn)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Pool {
    inner: r2d2::Pool<ConnectionManager>,
    backend: Backend,
    /// For connections that must not come from the pool (a LISTEN connection). Never shown.
    url: std::sync::Arc<str>,
    session: SessionSetup,
    /// Connections outside the pool that hold a session lock, kept for reuse (a lease
    /// guard's liveness lock, `lease::liveness`): closed when the last clone of the pool
    /// goes.
    spares: std::sync::Arc<std::sync::Mutex<Vec<(i64, AnyConnection)>>>,
    /// What [`Pool::get`] waits ([`PoolOptions::connection_timeout`]).
    connection_timeout: Duration,
}

/// The longest pause between two attempts to connect while the server is unreachable. r2d2
/// doubles its pause after each failed attempt up to half its `connection_timeout`: with the
/// default 30 s, a pool that lost its server for 13 s (a PostgreSQL failover) tried again
/// only 12.8 s after the new primary was up (measured: 25 s without a write). The pool gives
/// r2d2 a `connection_timeout` of twice this cap and waits its own timeout in [`Pool::get`].
const RECONNECT_BACKOFF_CAP: Duration = Duration::from_secs(1);

/// The most spare lock connections a pool keeps ([`Pool::keep_spare`]).
const MAX_SPARES: usize = 8;

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("backend", &self.backend)
            .field("state", &self.inner.state())
            .finish()
    }
}

impl Pool {
    /// Opens a pool with default options (see [`PoolOptions`]).
    pub fn open(url: &str) -> Result<Pool> {
        PoolOptions::default().open(url)
    }

    /// Options for a pool.
    pub fn options() -> PoolOptions {
        PoolOptions::default()
    }

    /// Checks out a connection, waiting up to the pool's connection timeout.
    pub fn get(&self) -> Result<PooledConnection> {
        Ok(self.inner.get_timeout(self.connection_timeout)?)
    }

    /// The database's URL, as the key of what this process's users of it share (never shown).
    pub(crate) fn url(&self) -> &std::sync::Arc<str> {
        &self.url
    }

    /// The backend this pool connects to.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The largest number of connections the pool opens.
    pub fn max_size(&self) -> u32 {
        self.inner.max_size()
    }

    /// A new connection to the same database with the same settings, outside the pool (for
    /// a connection held for good, like a PostgreSQL LISTEN connection).
    pub fn dedicated_connection(&self) -> Result<AnyConnection> {
        let mut conn = AnyConnection::connect_raw(&self.url)?;
        self.session.apply(&mut conn)?;
        Ok(conn)
    }

    /// Keeps `conn`, a connection outside the pool whose session holds lock `key`, for
    /// [`Pool::take_spare`]; dropped (closed) when the pool keeps enough.
    pub(crate) fn keep_spare(&self, key: i64, conn: AnyConnection) {
        let mut spares = self
            .spares
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if spares.len() < MAX_SPARES {
            spares.push((key, conn));
        }
    }

    /// A kept connection and the key of the lock its session held when it was kept.
    pub(crate) fn take_spare(&self) -> Option<(i64, AnyConnection)> {
        self.spares
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
    }

    /// The r2d2 pool itself, for its statistics and settings. Its own `connection_timeout`
    /// (what its `get` waits) is at most 2 s, not the pool's, so that it tries to connect
    /// again at least every second while the server is away (r2d2 pauses up to half of it
    /// between attempts): use [`Pool::get`], which waits the pool's timeout.
    pub fn r2d2(&self) -> &r2d2::Pool<ConnectionManager> {
        &self.inner
    }
}

/// Once per pool, when it opens: on a primary whose standbys do not confirm commits, a
/// failover can lose what tenure acknowledged (SCALING.md, "PostgreSQL with Patroni").
fn warn_if_asynchronous(conn: &mut AnyConnection) {
    match crate::replication(conn) {
        Ok(crate::Replication::Asynchronous { standbys }) => tracing::warn!(
            target: "tenure::pool",
            standbys,
            "the database streams to its standbys without confirming commits: a failover can \
             lose the jobs enqueued and finished and the leases granted in its last moments, \
             and grant a lease's fence twice (synchronous replication keeps them)"
        ),
        Ok(_) => {}
        Err(e) => {
            tracing::debug!(target: "tenure::pool", error = %e, "reading the database's replication failed")
        }
    }
}

/// How to open a [`Pool`].
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}", dir.path().join("app.db").display());
/// use std::time::Duration;
/// let pool = tenure::Pool::options()
///     .max_size(4)
///     .connection_timeout(Duration::from_secs(10))
///     .session(tenure::SessionSetup::default().synchronous(tenure::Synchronous::Normal))
///     .open(&url)?;
/// assert_eq!(pool.max_size(), 4);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PoolOptions {
    max_size: u32,
    connection_timeout: Duration,
    session: SessionSetup,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            max_size: 10,
            connection_timeout: Duration::from_secs(30),
            session: SessionSetup::default(),
        }
    }
}

impl PoolOptions {
    /// The largest number of connections (default 10).
    pub fn max_size(mut self, max_size: u32) -> Self {
        self.max_size = max_size;
        self
    }

    /// How long [`Pool::get`] waits for a free connection (default 30 s).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// The per-connection settings (default [`SessionSetup::default`]).
    pub fn session(mut self, session: SessionSetup) -> Self {
        self.session = session;
        self
    }

    /// Opens the pool. It connects once directly first, so an unreachable server or a
    /// rejected login is a prompt [`Error::Connect`] with the server's message, not r2d2's
    /// timeout with the cause flattened into a string.
    ///
    /// An in-memory SQLite database (`:memory:`) needs `max_size(1)`: the pool's one
    /// connection holds the database for the pool's life, never closed for being idle (for
    /// tests: [`crate::testing`]). With more connections it is refused: each would have its
    /// own empty database.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// let pool = tenure::Pool::options().max_size(1).open(":memory:")?;
    /// tenure::run_migrations(&mut pool.get()?)?;
    /// assert!(tenure::Pool::open(":memory:").is_err());
    /// # Ok(()) }
    /// ```
    pub fn open(self, url: &str) -> Result<Pool> {
        if self.max_size == 0 {
            return Err(Error::invalid(
                "max_size",
                "a pool needs at least one connection",
            ));
        }
        let (backend, target) = Backend::from_url(url)?;
        let in_memory =
            backend == Backend::Sqlite && (target == ":memory:" || target.contains("mode=memory"));
        if in_memory && self.max_size != 1 {
            return Err(Error::invalid(
                "database url",
                "an in-memory SQLite database can be pooled only with max_size(1) (each \
                 connection would get its own empty database); use a file",
            ));
        }
        let session_for_dedicated = self.session.clone();
        let mut probe = AnyConnection::connect_raw(url)?;
        self.session.apply(&mut probe)?;
        warn_if_asynchronous(&mut probe);
        drop(probe);
        // In memory, the one connection is the database: opened now, kept for good.
        let (min_idle, idle_timeout) = if in_memory {
            (1, None)
        } else {
            (0, Some(Duration::from_secs(600)))
        };
        let inner = r2d2::Pool::builder()
            .max_size(self.max_size)
            .min_idle(Some(min_idle))
            .idle_timeout(idle_timeout)
            .max_lifetime(idle_timeout.and(Some(Duration::from_secs(1800))))
            .connection_timeout(self.connection_timeout.min(2 * RECONNECT_BACKOFF_CAP))
            .connection_customizer(Box::new(self.session.clone()))
            .build(ConnectionManager {
                url: url.to_string(),
            })?;
        Ok(Pool {
            inner,
            backend,
            url: url.into(),
            session: session_for_dedicated,
            spares: Default::default(),
            connection_timeout: self.connection_timeout,
        })
    }
}

//! Which database a connection talks to, and the one place where tenure branches on it.
//!
//! Every operation that differs per backend is a trait with one implementation per backend,
//! in a file named after the backend beside the code that uses it (here: [`Dialect`] for the
//! foundation; the lease and job modules have their own). The only `match` on the backend is
//! [`dispatch!`], which hands the concrete diesel connection to that implementation.

use std::fmt;

use chrono::{DateTime, Utc};
use diesel::connection::{AnsiTransactionManager, Connection};
use diesel::result::QueryResult;

use crate::{Error, Result};

#[cfg(all(feature = "mysql", unix))]
mod descriptors;
#[cfg(feature = "sqlite")]
pub(crate) mod file_lock;
pub(crate) mod lease_listen;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod replication;
mod session;
#[cfg(feature = "sqlite")]
mod sqlite;
pub(crate) mod statement;
mod syntax;
pub(crate) use syntax::{Rendered, Syntax, Upsert};
pub(crate) mod transaction;
pub(crate) mod turns;

pub use replication::Replication;
pub use session::{SessionSetup, Synchronous};

#[cfg(feature = "mysql")]
use diesel::mysql::MysqlConnection;
#[cfg(feature = "postgres")]
use diesel::pg::PgConnection;
#[cfg(feature = "sqlite")]
use diesel::sqlite::SqliteConnection;

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!(
    "tenure needs at least one backend: enable the `sqlite`, `postgres` or `mysql` feature"
);

/// The three databases tenure supports. Always has all three variants, whichever features are
/// enabled, so that errors and URLs can name a backend that is not compiled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// SQLite (bundled), feature `sqlite`.
    Sqlite,
    /// PostgreSQL, feature `postgres`.
    Postgres,
    /// MySQL or MariaDB, feature `mysql`.
    Mysql,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Sqlite => "SQLite",
            Backend::Postgres => "PostgreSQL",
            Backend::Mysql => "MySQL/MariaDB",
        })
    }
}

impl Backend {
    /// Chooses the backend from a URL's scheme and returns the string diesel's connection of
    /// that backend expects.
    ///
    /// `postgres://` and `postgresql://` are PostgreSQL; `mysql://` and `mariadb://` are
    /// MySQL/MariaDB; `sqlite://PATH`, `file:...` (an SQLite URI), `:memory:` and anything
    /// without a scheme are SQLite. Any other scheme is [`Error::UnsupportedUrl`].
    ///
    /// ```
    /// use tenure::Backend;
    /// assert_eq!(Backend::from_url("postgres://u@host/db").unwrap().0, Backend::Postgres);
    /// assert_eq!(Backend::from_url("mariadb://u@host/db").unwrap().1, "mysql://u@host/db");
    /// assert_eq!(Backend::from_url("sqlite://jobs.db").unwrap(), (Backend::Sqlite, "jobs.db".to_string()));
    /// assert!(Backend::from_url("redis://host").is_err());
    /// ```
    pub fn from_url(url: &str) -> Result<(Backend, String)> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Ok((Backend::Sqlite, url.to_string()));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "postgres" | "postgresql" => Ok((Backend::Postgres, url.to_string())),
            "mysql" => Ok((Backend::Mysql, url.to_string())),
            "mariadb" => Ok((Backend::Mysql, format!("mysql://{rest}"))),
            "sqlite" => Ok((Backend::Sqlite, rest.to_string())),
            // "file:" URIs have no "//" after the colon in the common case, but may.
            "file" => Ok((Backend::Sqlite, url.to_string())),
            // A "scheme" of other characters is some other text before a `://` (a password,
            // say): not repeated.
            _ if !scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
            {
                Err(Error::UnsupportedUrl {
                    scheme: "(not a scheme)".to_string(),
                })
            }
            _ => Err(Error::UnsupportedUrl {
                scheme: scheme.to_string(),
            }),
        }
    }

    fn not_enabled(self) -> Error {
        let (backend, feature) = match self {
            Backend::Sqlite => ("SQLite", "sqlite"),
            Backend::Postgres => ("PostgreSQL", "postgres"),
            Backend::Mysql => ("MySQL/MariaDB", "mysql"),
        };
        Error::BackendNotEnabled { backend, feature }
    }
}

/// The concrete diesel connection behind any [`TenureConnection`].
#[non_exhaustive]
pub enum BackendConnection<'a> {
    /// An SQLite connection.
    #[cfg(feature = "sqlite")]
    Sqlite(&'a mut SqliteConnection),
    /// A PostgreSQL connection.
    #[cfg(feature = "postgres")]
    Postgres(&'a mut PgConnection),
    /// A MySQL/MariaDB connection.
    #[cfg(feature = "mysql")]
    Mysql(&'a mut MysqlConnection),
}

impl BackendConnection<'_> {
    /// Which backend this is.
    pub fn backend(&self) -> Backend {
        match self {
            #[cfg(feature = "sqlite")]
            BackendConnection::Sqlite(_) => Backend::Sqlite,
            #[cfg(feature = "postgres")]
            BackendConnection::Postgres(_) => Backend::Postgres,
            #[cfg(feature = "mysql")]
            BackendConnection::Mysql(_) => Backend::Mysql,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A connection tenure can work on: diesel's `SqliteConnection`, `PgConnection`,
/// `MysqlConnection`, tenure's [`AnyConnection`] (backend chosen at run time), and an r2d2
/// pooled connection of any of them.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::TenureConnection;
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// assert_eq!(conn.backend(), tenure::Backend::Sqlite);
/// # Ok(()) }
/// ```
pub trait TenureConnection: sealed::Sealed + Send {
    /// The concrete diesel connection, for the one `match` that picks the backend's SQL.
    fn backend_connection(&mut self) -> BackendConnection<'_>;

    /// Which backend this connection talks to.
    fn backend(&mut self) -> Backend {
        self.backend_connection().backend()
    }
}

/// Runs `$body` with `$c` bound to the concrete connection behind `$conn`. `$body` is written
/// once and compiled per backend, so it calls a trait that each backend implements.
///
/// On PostgreSQL a result that is a refused stale prepared statement makes the connection
/// forget its prepared statements (see `postgres::forget_stale_plans`); on MySQL/MariaDB any
/// database error does (see `mysql::forget_failed_statements`). `dispatch!(any ...)` skips
/// that, for a body whose error type tenure cannot look into (a caller's own).
macro_rules! dispatch {
    (any $conn:expr, $c:ident => $body:expr) => {
        match $crate::TenureConnection::backend_connection($conn) {
            #[cfg(feature = "sqlite")]
            $crate::BackendConnection::Sqlite($c) => $body,
            #[cfg(feature = "postgres")]
            $crate::BackendConnection::Postgres($c) => $body,
            #[cfg(feature = "mysql")]
            $crate::BackendConnection::Mysql($c) => $body,
        }
    };
    ($conn:expr, $c:ident => $body:expr) => {
        match $crate::TenureConnection::backend_connection($conn) {
            #[cfg(feature = "sqlite")]
            $crate::BackendConnection::Sqlite($c) => $body,
            #[cfg(feature = "postgres")]
            $crate::BackendConnection::Postgres($c) => {
                let result = $body;
                $crate::backend::postgres::forget_stale_plans($c, &result);
                result
            }
            #[cfg(feature = "mysql")]
            $crate::BackendConnection::Mysql($c) => {
                let result = $body;
                $crate::backend::mysql::forget_failed_statements($c, &result);
                result
            }
        }
    };
}
pub(crate) use dispatch;

macro_rules! concrete_connection {
    ($feature:literal, $ty:ty, $variant:ident) => {
        #[cfg(feature = $feature)]
        impl sealed::Sealed for $ty {}
        #[cfg(feature = $feature)]
        impl TenureConnection for $ty {
            fn backend_connection(&mut self) -> BackendConnection<'_> {
                BackendConnection::$variant(self)
            }
        }
    };
}
concrete_connection!("sqlite", SqliteConnection, Sqlite);
concrete_connection!("postgres", PgConnection, Postgres);
concrete_connection!("mysql", MysqlConnection, Mysql);

impl<M> sealed::Sealed for r2d2::PooledConnection<M>
where
    M: r2d2::ManageConnection,
    M::Connection: TenureConnection,
{
}
impl<M> TenureConnection for r2d2::PooledConnection<M>
where
    M: r2d2::ManageConnection,
    M::Connection: TenureConnection,
{
    fn backend_connection(&mut self) -> BackendConnection<'_> {
        (**self).backend_connection()
    }
}

// `#[derive(MultiConnection)]` ignores `#[cfg]` on variants, so the enum is written once per
// feature set by this macro.
macro_rules! any_connection {
    ($($variant:ident($ty:ident)),+) => {
        /// A diesel connection whose backend is chosen at run time from the URL (see
        /// [`AnyConnection::connect`]). It is a diesel connection: queries common to the
        /// enabled backends run on it, and `match` on it reaches the concrete connection.
        ///
        /// ```
        /// # fn main() -> Result<(), tenure::Error> {
        /// let mut conn = tenure::AnyConnection::connect(":memory:")?;
        /// tenure::run_migrations(&mut conn)?;
        /// # Ok(()) }
        /// ```
        #[derive(diesel::MultiConnection)]
        pub enum AnyConnection {
            $(
                #[allow(missing_docs)]
                $variant($ty),
            )+
        }

        impl fmt::Debug for AnyConnection {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $(AnyConnection::$variant(_) => f.write_str(concat!("AnyConnection::", stringify!($variant))),)+
                }
            }
        }

        impl sealed::Sealed for AnyConnection {}
        impl TenureConnection for AnyConnection {
            fn backend_connection(&mut self) -> BackendConnection<'_> {
                match self {
                    $(AnyConnection::$variant(c) => BackendConnection::$variant(c),)+
                }
            }
        }
    };
}

#[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
any_connection!(
    Sqlite(SqliteConnection),
    Postgres(PgConnection),
    Mysql(MysqlConnection)
);
#[cfg(all(feature = "sqlite", feature = "postgres", not(feature = "mysql")))]
any_connection!(Sqlite(SqliteConnection), Postgres(PgConnection));
#[cfg(all(feature = "sqlite", not(feature = "postgres"), feature = "mysql"))]
any_connection!(Sqlite(SqliteConnection), Mysql(MysqlConnection));
#[cfg(all(not(feature = "sqlite"), feature = "postgres", feature = "mysql"))]
any_connection!(Postgres(PgConnection), Mysql(MysqlConnection));
#[cfg(all(feature = "sqlite", not(feature = "postgres"), not(feature = "mysql")))]
any_connection!(Sqlite(SqliteConnection));
#[cfg(all(not(feature = "sqlite"), feature = "postgres", not(feature = "mysql")))]
any_connection!(Postgres(PgConnection));
#[cfg(all(not(feature = "sqlite"), not(feature = "postgres"), feature = "mysql"))]
any_connection!(Mysql(MysqlConnection));

/// tenure's portable SQL types through [`AnyConnection`]'s backend, so that queries on
/// [`crate::schema`] (and your own columns of these types) run on an `AnyConnection` or a pool
/// of it: each value is handed to the backend the connection has.
mod any_backend_types {
    use chrono::{DateTime, Utc};
    use diesel::backend::Backend;
    use diesel::deserialize::{self, FromSql};
    use diesel::serialize::{self, IsNull, Output, ToSql};
    use diesel::sql_types::HasSqlType;

    use super::MultiBackend;
    use crate::sql_types::{Instant, Token};

    macro_rules! portable {
        ($sql_type:ident, $rust:ty) => {
            impl HasSqlType<$sql_type> for MultiBackend {
                fn metadata(lookup: &mut Self::MetadataLookup) -> Self::TypeMetadata {
                    MultiBackend::lookup_sql_type::<$sql_type>(lookup)
                }
            }

            impl FromSql<$sql_type, MultiBackend> for $rust {
                fn from_sql(
                    bytes: <MultiBackend as Backend>::RawValue<'_>,
                ) -> deserialize::Result<Self> {
                    bytes.from_sql::<Self, $sql_type>()
                }
            }

            impl ToSql<$sql_type, MultiBackend> for $rust {
                fn to_sql<'b>(
                    &'b self,
                    out: &mut Output<'b, '_, MultiBackend>,
                ) -> serialize::Result {
                    out.set_value(($sql_type, self));
                    Ok(IsNull::No)
                }
            }
        };
    }
    portable!(Instant, DateTime<Utc>);

    impl diesel::query_builder::QueryFragment<MultiBackend> for crate::sql_types::DatabaseNow {
        fn walk_ast<'b>(
            &'b self,
            pass: diesel::query_builder::AstPass<'_, 'b, MultiBackend>,
        ) -> diesel::QueryResult<()> {
            MultiBackend::walk_variant_ast(self, pass)
        }
    }
    portable!(Token, uuid::Uuid);
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
impl AnyConnection {
    /// Connects to the database a URL names (see [`Backend::from_url`] for the schemes), with
    /// the session settings a [`Pool`](crate::Pool) applies by default
    /// ([`SessionSetup::default`]): on SQLite a busy timeout of 5 s (so a second writer waits
    /// instead of failing at once with "database is locked"), WAL, `synchronous = FULL` and
    /// foreign keys; on MySQL/MariaDB UTC and strict mode. For other settings, or none, use
    /// [`AnyConnection::connect_raw`] and [`SessionSetup::apply`].
    ///
    /// Unlike diesel's `establish` on a derived multi-connection, which tries every backend
    /// and reports only "invalid connection url", this picks the backend from the scheme and
    /// returns that backend's own error as [`Error::Connect`]. The URL is never part of an
    /// error, since it may hold a password.
    ///
    /// ```
    /// let err = tenure::AnyConnection::connect("ftp://example").unwrap_err();
    /// assert!(matches!(err, tenure::Error::UnsupportedUrl { .. }));
    /// ```
    pub fn connect(url: &str) -> Result<Self> {
        let mut conn = AnyConnection::connect_raw(url)?;
        SessionSetup::default().apply(&mut conn)?;
        Ok(conn)
    }

    /// Like [`AnyConnection::connect`], without any session settings: the connection is as
    /// the driver opens it (on SQLite: no busy timeout, so a write that meets another
    /// connection's write lock fails at once; the file's journal mode as it is). Apply your
    /// own with [`SessionSetup::apply`].
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// use std::time::Duration;
    /// let mut conn = tenure::AnyConnection::connect_raw(":memory:")?;
    /// tenure::SessionSetup::default().busy_timeout(Duration::from_secs(30)).apply(&mut conn)?;
    /// # Ok(()) }
    /// ```
    pub fn connect_raw(url: &str) -> Result<Self> {
        let (backend, target) = Backend::from_url(url)?;
        let connect_error = |source| Error::Connect {
            backend,
            source: crate::redact::connection_error(source, url),
        };
        match backend {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite => SqliteConnection::establish(&target)
                .map(AnyConnection::Sqlite)
                .map_err(connect_error),
            #[cfg(feature = "postgres")]
            Backend::Postgres => PgConnection::establish(&target)
                .map(AnyConnection::Postgres)
                .map_err(connect_error),
            #[cfg(feature = "mysql")]
            Backend::Mysql => {
                #[cfg(unix)]
                let before = descriptors::open_descriptors();
                let connected = MysqlConnection::establish(&target);
                #[cfg(unix)]
                descriptors::close_on_exec_since(&before);
                connected.map(AnyConnection::Mysql).map_err(connect_error)
            }
            #[allow(unreachable_patterns)]
            other => Err(other.not_enabled()),
        }
    }
}

/// The database's clock, as each backend's `database_now` reads it.
#[derive(diesel::QueryableByName)]
pub(crate) struct Now {
    #[diesel(sql_type = crate::sql_types::Instant)]
    pub now: DateTime<Utc>,
}

/// The PostgreSQL channel that enqueues notify and idle workers listen to.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) const NOTIFY_CHANNEL: &str = "tenure_jobs";

/// The foundation's per-backend SQL: session settings, the transaction tenure's writes run in,
/// the database clock, and migrations under a lock. One implementation per backend file.
pub(crate) trait Dialect: Connection<TransactionManager = AnsiTransactionManager> {
    /// The backend's SQL fragments.
    fn syntax(&self) -> &'static Syntax;

    /// Per-connection settings (SQLite pragmas, MySQL time zone and SQL mode).
    fn setup_session(&mut self, setup: &SessionSetup) -> QueryResult<()>;

    /// Begins the transaction tenure's own writes need (SQLite IMMEDIATE, MySQL READ COMMITTED,
    /// PostgreSQL READ COMMITTED). Fails with `AlreadyInTransaction` inside a caller's
    /// transaction, before sending anything.
    fn begin_write(&mut self) -> QueryResult<()>;

    /// After an error inside a transaction tenure began: whether the server no longer has a
    /// transaction open, so something else rolled it back (a Galera node aborts the loser of a
    /// conflict with another node's commit, and may report that as another error). Only
    /// MySQL/MariaDB asks; a question that failed with a retryable error (the abort's, reported
    /// to it) says yes, any other failure no.
    fn transaction_ended_under_us(&mut self) -> bool {
        false
    }

    /// After a transaction of tenure's failed (and was rolled back): whether `err` was a
    /// cluster's abort in disguise, which the connection has recovered from (see
    /// `mysql::is_abort_in_disguise`), so the transaction may be repeated.
    fn recover_from_disguised_abort(&mut self, _err: &crate::Error) -> bool {
        false
    }

    /// Just before tenure commits a transaction it began: whether the server already ended it.
    /// A Galera node can roll a transaction back after its last statement without telling the
    /// client, and then a COMMIT, which finds none open, succeeds and commits nothing. Asked
    /// only where that can happen (MySQL connections of a process that met a Galera node). An
    /// error is the question's (when the node does report an abort, it reports it to the next
    /// statement, which this is): the transaction is not to be committed then either.
    fn ended_before_commit(&mut self) -> QueryResult<bool> {
        Ok(false)
    }

    /// Before tenure writes on a connection outside any transaction: waits for this process's
    /// turn to write to the database (SQLite, see [`turns`]). `None` where writers need no
    /// turns (the servers lock rows, not the database), inside a transaction (the turn was
    /// taken when it began, or the caller's own transaction is not tenure's to queue), and for
    /// a private in-memory database.
    fn write_turn(&mut self) -> QueryResult<Option<turns::Turn>> {
        Ok(None)
    }

    /// The database's clock, in UTC.
    fn database_now(&mut self) -> QueryResult<DateTime<Utc>>;

    /// Runs tenure's pending migrations, serialized against other processes doing the same.
    fn migrate(&mut self) -> Result<Vec<String>>;

    /// How the server replicates commits ([`Replication`]).
    fn replication(&mut self) -> Result<Replication>;
}

#[cfg(feature = "sqlite")]
pub(crate) use file_lock::FileLock;

/// Without SQLite there are no lock files.
#[cfg(not(feature = "sqlite"))]
#[derive(Debug)]
pub(crate) struct FileLock;

#[cfg(not(feature = "sqlite"))]
impl FileLock {
    pub fn remove(self) {}
}

/// Whose lock a liveness lock is: the two kinds never share a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockSpace {
    /// A worker's registration (`tenure_workers.id`, see `jobs::registry`).
    Worker,
    /// A lease holder's process (`tenure_leases.held_by`, see `lease::liveness`).
    LeaseHolder,
}

/// Where a liveness lock is held (a worker's, see `jobs::registry`; a lease holder's, see
/// `lease::liveness`): it lasts as long as its process, and no longer.
#[derive(Debug)]
pub(crate) enum LivenessLock {
    /// By the session of the connection that took it (PostgreSQL, MySQL/MariaDB): the
    /// server frees it when the session ends.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    Session,
    /// By an exclusive `flock` of its lock file (SQLite): the kernel frees it when the
    /// process ends.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    File(FileLock),
    /// Nowhere: nothing can tell this process's death (an SQLite database in memory, or a
    /// platform without `flock`). What it holds is protected by its ttl alone.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Nowhere,
}

/// What a look at another process's liveness lock finds (a rescue's, a lease grant's).
#[derive(Debug)]
pub(crate) enum Probe {
    /// Held: the worker lives (or its session does).
    Held,
    /// Free: the worker's session (or process) ended. On PostgreSQL the rescue's transaction
    /// holds it until it ends; on SQLite the file lock given here does, until dropped.
    Free(Option<FileLock>),
    /// Nothing can be told (SQLite: no lock file where it should be): taken as alive.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Unknown,
}

/// How a process says it lives, per backend: a lock that ends with its process (see
/// `jobs::registry`, and `jobs::queue::rescue` for how a dead worker is recognised; and
/// `lease::liveness` for a lease holder's). One implementation per backend file.
pub(crate) trait Liveness: Dialect {
    /// Takes lock `id` of `space`: for this connection's session (servers) or in its lock
    /// file (SQLite). `None` if another holds it.
    fn take_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Option<LivenessLock>>;

    /// Whether this connection's session holds lock `id` of `space` (servers; SQLite's file
    /// lock cannot be lost while the process lives).
    fn holds_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<bool>;

    /// Inside a transaction (a rescue's, a lease grant's): whether lock `id` of `space` is
    /// free.
    fn probe_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Probe>;
}

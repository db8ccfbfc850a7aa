//! The one error type of dibs, and how to tell what a caller can do about an error.

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use crate::Backend;

/// Everything that can go wrong in dibs.
///
/// Three questions a caller usually asks are answered by methods rather than by matching:
/// [`Error::is_retryable`] (a transient conflict: the same call may simply be repeated),
/// [`Error::is_outcome_unknown`] (the connection was lost mid-call: the write may or may not
/// have happened) and [`Error::is_invalid_input`] (the call itself is wrong; nothing was
/// written).
///
/// A database error is never turned into "nothing there": when a dibs operation cannot tell,
/// it returns an error.
///
/// ```
/// let err = dibs::AnyConnection::connect("redis://localhost").unwrap_err();
/// assert!(matches!(err, dibs::Error::UnsupportedUrl { .. }));
/// assert!(!err.is_retryable());
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument was rejected before any statement ran: nothing was written.
    #[error("invalid {field}: {reason}")]
    InvalidInput {
        /// Which argument (`"lease name"`, `"ttl"`, ...).
        field: &'static str,
        /// Why it was rejected, in words.
        reason: String,
    },

    /// The URL's scheme names no database dibs knows. The URL itself is not repeated, since it
    /// may hold a password.
    #[error(
        "unsupported database URL scheme {scheme:?}: use postgres://, postgresql://, mysql://, \
         mariadb://, sqlite:// or a file path"
    )]
    UnsupportedUrl {
        /// The scheme found (the text before `://`).
        scheme: String,
    },

    /// The URL names a backend whose cargo feature is not enabled in this build.
    #[error("the {backend} backend is not compiled in: enable dibs's `{feature}` cargo feature")]
    BackendNotEnabled {
        /// The backend the URL asked for.
        backend: &'static str,
        /// The cargo feature that enables it.
        feature: &'static str,
    },

    /// Connecting failed; `source` is the server's (or client library's) own error.
    #[error("could not connect to {backend}: {source}")]
    Connect {
        /// The backend that was tried.
        backend: Backend,
        /// What diesel reported, with the server's message.
        #[source]
        source: diesel::ConnectionError,
    },

    /// The operation needs a connection that is not inside a transaction (see the crate docs:
    /// "Caller's transactions").
    #[error(
        "{operation} needs a connection outside any transaction: it opens the transaction it \
         needs itself"
    )]
    InTransaction {
        /// The operation that refused.
        operation: &'static str,
    },

    /// The lease is no longer held by this token: it lapsed (whether or not someone else took
    /// it since), was released, or was taken over. Work under it must stop; once lost, a
    /// lease stays lost.
    #[error("lease {name:?} is lost: it lapsed, was released or was taken over")]
    LeaseLost {
        /// The lease's name.
        name: String,
    },

    /// An error from the database, unchanged.
    #[error("database error: {0}")]
    Database(#[from] DieselError),

    /// Running migrations failed; what was applied before the failing step stays applied and
    /// recorded, the failing step is not recorded.
    #[error("migration failed: {0}")]
    Migration(String),

    /// Waiting for something (a lock, a lease) took longer than allowed.
    #[error("timed out waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
    },

    /// The connection pool could not hand out a connection in time.
    #[error("connection pool: {0}")]
    Pool(#[from] r2d2::Error),
}

/// `Result` with dibs's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            field,
            reason: reason.into(),
        }
    }

    /// True for transient conflicts after which the whole call can be repeated as it is:
    /// serialization failures and deadlocks (PostgreSQL 40001, 40P01; MySQL/MariaDB 1213),
    /// lock timeouts (PostgreSQL 55P03; MySQL/MariaDB 1205), MariaDB's 1020 ("record has
    /// changed"), SQLite's `SQLITE_BUSY`, and a pool that had no free connection in time.
    ///
    /// diesel exposes the code only for 40001 and 1213; the others are recognised by the
    /// server's message, which PostgreSQL translates when `lc_messages` is not English.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database(DieselError::DatabaseError(kind, info)) => {
                matches!(kind, DatabaseErrorKind::SerializationFailure)
                    || is_transient_message(info.message())
            }
            Error::Pool(_) | Error::Timeout { .. } => true,
            _ => false,
        }
    }

    /// True when the connection broke during the call, so the database may or may not have
    /// applied it. Such an error is not "failed": check the state before doing it again.
    pub fn is_outcome_unknown(&self) -> bool {
        match self {
            Error::Database(DieselError::DatabaseError(kind, info)) => {
                matches!(
                    kind,
                    DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand
                ) || is_lost_connection_message(info.message())
            }
            _ => false,
        }
    }

    /// True when a lease this caller held is lost ([`Error::LeaseLost`]).
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::LeaseLost { .. })
    }

    /// True when the arguments were rejected before anything was sent to the database.
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, Error::InvalidInput { .. })
    }
}

/// Messages of the transient errors diesel does not give a kind for (see `is_retryable`).
fn is_transient_message(message: &str) -> bool {
    const TRANSIENT: &[&str] = &[
        "deadlock detected",                       // PostgreSQL 40P01
        "could not obtain lock",                   // PostgreSQL 55P03 (NOWAIT)
        "canceling statement due to lock timeout", // PostgreSQL 55P03 (lock_timeout)
        "Deadlock found",                          // MySQL/MariaDB 1213
        "Lock wait timeout exceeded",              // MySQL/MariaDB 1205
        "Record has changed since last read",      // MariaDB 1020
        "database is locked",                      // SQLITE_BUSY
        "database table is locked",                // SQLITE_LOCKED (shared cache)
    ];
    TRANSIENT.iter().any(|t| message.contains(t))
}

fn is_lost_connection_message(message: &str) -> bool {
    const LOST: &[&str] = &[
        "server has gone away",                      // MySQL 2006
        "Lost connection to",                        // MySQL 2013
        "server closed the connection unexpectedly", // libpq
        "terminating connection",                    // PostgreSQL 57P01 and friends
        "no connection to the server",               // libpq
    ];
    LOST.iter().any(|t| message.contains(t))
}

//! The one error type of tenure, and how to tell what a caller can do about an error.

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use crate::Backend;

/// Everything that can go wrong in tenure.
///
/// Three questions a caller usually asks are answered by methods rather than by matching:
/// [`Error::is_retryable`] (a transient conflict: the same call may simply be repeated),
/// [`Error::is_outcome_unknown`] (the connection was lost mid-call: the write may or may not
/// have happened) and [`Error::is_invalid_input`] (the call itself is wrong; nothing was
/// written).
///
/// A database error is never turned into "nothing there": when a tenure operation cannot tell,
/// it returns an error.
///
/// ```
/// let err = tenure::AnyConnection::connect("redis://localhost").unwrap_err();
/// assert!(matches!(err, tenure::Error::UnsupportedUrl { .. }));
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

    /// The URL's scheme names no database tenure knows. The URL itself is not repeated, since it
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
    #[error("the {backend} backend is not compiled in: enable tenure's `{feature}` cargo feature")]
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

    /// A take asked for a number of holders other than the one the lease's current holders
    /// took it with: a name keeps one number of holders while anyone holds it (or its lock
    /// delay runs). Nothing changed.
    #[error("lease {name:?} is held by up to {holders} at once; this take asked for {asked}")]
    LeaseHoldersMismatch {
        /// The lease's name.
        name: String,
        /// The number of holders its current holders took it with.
        holders: u32,
        /// The number this take asked for.
        asked: u32,
    },

    /// [`LeaseGuard::release`](crate::LeaseGuard::release) (or dropping the guard) could not
    /// release the lease within [`RELEASE_WAIT`](crate::lease::RELEASE_WAIT): its row is
    /// locked by an open transaction that ran [`Lease::verify`](crate::lease::Lease::verify),
    /// most often the caller's own on this thread, which the release would wait for forever.
    /// Nothing is lost: the release completes in the background once that transaction ends
    /// (or the lease lapses, as it is renewed no more). Inside such a transaction, release
    /// with [`LeaseGuard::release_on`](crate::LeaseGuard::release_on) instead.
    #[error(
        "releasing lease {name:?} waits for its row, locked by an open transaction that ran \
         Lease::verify (on this thread?): release inside it with LeaseGuard::release_on, or \
         after it ends; the release completes once the row is free"
    )]
    LeaseReleasePending {
        /// The lease's name.
        name: String,
    },

    /// A transaction of tenure's was rolled back by something outside it: a Galera node aborts
    /// the loser of a conflict with another node's transaction, and may do so between two
    /// statements (which then run on), after the last one (a COMMIT then commits nothing:
    /// tenure asks before committing on a Galera node), or report it as another error (a
    /// duplicate key, a trigger it could not load). Nothing it wrote is kept; the same call
    /// may be repeated ([`Error::is_retryable`]).
    #[error(
        "{operation}: the transaction lost a row it held (rolled back by a conflict, as a cluster does); retry"
    )]
    RolledBackUnderUs {
        /// What was being done.
        operation: &'static str,
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

    /// There is no job with this id: never enqueued, or deleted by retention.
    #[error("no job {id} (never enqueued, or deleted by retention)")]
    NoSuchJob {
        /// The id asked for.
        id: i64,
    },

    /// [`crate::jobs::wait`] reached its timeout before the job ended; the job is unchanged.
    #[error("job {id} has not ended: it is still {}", state.as_str())]
    WaitTimedOut {
        /// The job.
        id: i64,
        /// Its state at the timeout.
        state: crate::jobs::JobState,
    },

    /// There is no workflow with this id: never enqueued, or pruned with its last job.
    #[error("no workflow {id} (never enqueued, or pruned with its jobs)")]
    NoSuchWorkflow {
        /// The id asked for.
        id: i64,
    },

    /// [`crate::jobs::wait_workflow`] reached its timeout before every job of the workflow
    /// ended; nothing changed.
    #[error("workflow {id} has not ended: {unfinished} of its jobs have not")]
    WorkflowWaitTimedOut {
        /// The workflow.
        id: i64,
        /// How many of its jobs had not ended at the timeout.
        unfinished: usize,
    },

    /// A park token was refused ([`crate::jobs::complete_parked`], `fail_parked`,
    /// `resume_parked`): nothing changed. The error never holds the token.
    #[error("park token refused: {0}")]
    ParkTokenRefused(crate::jobs::ParkRefusal),

    /// The run no longer holds job `id`'s claim (it lapsed and was rescued, was cancelled or
    /// asked to cancel, finished, or another run has the job now): what it was about to commit with the claim
    /// was rolled back ([`crate::worker::JobContext::step`]), or nothing was parked
    /// ([`crate::worker::JobContext::park`]). The run should stop; the job's current run
    /// carries on.
    #[error(
        "the run no longer holds job {id}'s claim: nothing it was about to commit with it was kept"
    )]
    ClaimLost {
        /// The job.
        id: i64,
    },

    /// The connection pool could not hand out a connection in time.
    #[error("connection pool: {0}")]
    Pool(#[from] r2d2::Error),

    /// A worker's lock file (SQLite: `<database>-workers/<id>`, whose lock says the worker
    /// lives) could not be created, locked or removed.
    #[error("worker lock file {path}: {source}")]
    LockFile {
        /// The file.
        path: std::path::PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
}

/// `Result` with tenure's [`Error`].
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
    /// changed") and 1412 ("table definition has changed": a REPEATABLE READ transaction
    /// whose read view is older than a ready ring rotation changed a waiting job), SQLite's `SQLITE_BUSY`, a pool that had no free connection in time, and
    /// a call refused, before it sent anything, on a connection whose transaction an earlier
    /// lost connection left broken (diesel's `BrokenTransactionManager`: repeat it on a new
    /// connection; a pool discards that one).
    ///
    /// diesel exposes the code only for 40001 and 1213; the others are recognised by the
    /// server's message, which PostgreSQL translates when `lc_messages` is not English.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database(error) => is_transient(error),
            Error::Pool(_) | Error::Timeout { .. } | Error::RolledBackUnderUs { .. } => true,
            _ => false,
        }
    }

    /// True for a deadlock or a serialization failure: a conflict the server reported at
    /// once, as opposed to a wait that ran out (a lock timeout, SQLite's busy timeout).
    pub(crate) fn is_conflict(&self) -> bool {
        match self {
            Error::Database(DieselError::DatabaseError(kind, info)) => {
                matches!(kind, DatabaseErrorKind::SerializationFailure)
                    || info.message().contains("deadlock detected")
                    || info.message().contains("Deadlock found")
            }
            _ => false,
        }
    }

    /// True when the connection broke during the call, so the database may or may not have
    /// applied it. Such an error is not "failed": check the state before doing it again.
    ///
    /// diesel gives no error number for MySQL/MariaDB (only the message, and a kind for a
    /// few constraint errors), so these are recognised by the client's and server's message
    /// texts, compared without regard to case: 2006 "(MySQL) server has gone away", 2013 and
    /// 2055 "Lost connection to (MySQL) server", 1927 "Connection was killed" (MariaDB: a
    /// `KILL` while the statement ran or waited for a lock), 1053 "Server shutdown in
    /// progress", 4031 "disconnected by the server because of inactivity" (MySQL 8);
    /// PostgreSQL's 57P01-57P03 ("terminating connection ...") and libpq's lost-connection
    /// messages.
    ///
    /// A COMMIT that failed, followed by a rollback that failed too (diesel's
    /// `RollbackErrorOnCommit`), is judged by both: the commit may have been applied.
    pub fn is_outcome_unknown(&self) -> bool {
        match self {
            Error::Database(error) => is_lost_connection(error),
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
/// A transient conflict, also behind a failed commit's rollback.
fn is_transient(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(kind, info) => {
            matches!(kind, DatabaseErrorKind::SerializationFailure)
                || is_transient_message(info.message())
        }
        DieselError::RollbackErrorOnCommit {
            commit_error,
            rollback_error,
        } => is_transient(commit_error) && !is_lost_connection(rollback_error),
        // An earlier call lost the connection mid-transaction: this one sent nothing. It
        // goes through on a new connection (a pool discards this one).
        DieselError::BrokenTransactionManager => true,
        _ => false,
    }
}

/// A connection that broke during the call, also behind a failed commit's rollback.
fn is_lost_connection(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(kind, info) => {
            matches!(
                kind,
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand
            ) || is_lost_connection_message(info.message())
        }
        DieselError::RollbackErrorOnCommit {
            commit_error,
            rollback_error,
        } => is_lost_connection(commit_error) || is_lost_connection(rollback_error),
        _ => false,
    }
}

/// PostgreSQL refuses a prepared statement whose result columns changed type since it was
/// prepared (a migration changed a column tenure reads). tenure then forgets every statement the
/// connection has prepared (`backend::postgres::forget_stale_plans`), so the call can be
/// repeated as it is.
const STALE_PLAN: &str = "cached plan must not change result type";

/// The error or the result of a call that might carry a database error.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) trait DatabaseFailure {
    /// The database error behind it, if there is one.
    fn database_error(&self) -> Option<&DieselError>;

    /// Whether it is PostgreSQL refusing a prepared statement after a column type changed.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn is_stale_plan(&self) -> bool {
        match self.database_error() {
            Some(DieselError::DatabaseError(_, info)) => info.message().contains(STALE_PLAN),
            _ => false,
        }
    }
}

impl DatabaseFailure for DieselError {
    fn database_error(&self) -> Option<&DieselError> {
        Some(self)
    }
}

impl DatabaseFailure for Error {
    fn database_error(&self) -> Option<&DieselError> {
        match self {
            Error::Database(error) => Some(error),
            _ => None,
        }
    }
}

impl<T, E: DatabaseFailure> DatabaseFailure for std::result::Result<T, E> {
    fn database_error(&self) -> Option<&DieselError> {
        self.as_ref().err().and_then(E::database_error)
    }
}

fn is_transient_message(message: &str) -> bool {
    const TRANSIENT: &[&str] = &[
        "deadlock detected",                       // PostgreSQL 40P01
        "could not obtain lock",                   // PostgreSQL 55P03 (NOWAIT)
        "canceling statement due to lock timeout", // PostgreSQL 55P03 (lock_timeout)
        "Deadlock found",                          // MySQL/MariaDB 1213
        "Lock wait timeout exceeded",              // MySQL/MariaDB 1205
        "Record has changed since last read",      // MariaDB 1020
        "Table definition has changed",            // MySQL/MariaDB 1412 (a ring rotation)
        "database is locked",                      // SQLITE_BUSY
        "database table is locked",                // SQLITE_LOCKED (shared cache)
        STALE_PLAN,                                // PostgreSQL 0A000, see below
    ];
    TRANSIENT.iter().any(|t| message.contains(t))
}

/// Messages of a connection lost mid-call (see `is_outcome_unknown`), in lower case: clients
/// and servers differ in capitals ("MySQL server has gone away", MariaDB Connector/C's
/// "Server has gone away").
fn is_lost_connection_message(message: &str) -> bool {
    const LOST: &[&str] = &[
        "server has gone away",                             // MySQL/MariaDB 2006
        "lost connection to",                               // MySQL/MariaDB 2013, 2055
        "connection was killed",                            // MariaDB 1927 (KILL)
        "server shutdown in progress",                      // MySQL/MariaDB 1053
        "disconnected by the server because of inactivity", // MySQL 8 4031
        "server closed the connection unexpectedly",        // libpq
        "terminating connection",                           // PostgreSQL 57P01 and friends
        "no connection to the server",                      // libpq
        "could not receive data from server",               // libpq
        "could not send data to server",                    // libpq
    ];
    let message = message.to_lowercase();
    LOST.iter().any(|t| message.contains(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database_error(message: &str) -> Error {
        Error::Database(DieselError::DatabaseError(
            DatabaseErrorKind::Unknown,
            Box::new(message.to_string()),
        ))
    }

    #[test]
    fn deadlocks_are_conflicts_and_waits_that_ran_out_are_not() {
        for message in [
            "deadlock detected",
            "Deadlock found when trying to get lock; try restarting transaction",
        ] {
            assert!(database_error(message).is_conflict(), "{message:?}");
        }
        let serialization = Error::Database(DieselError::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            Box::new("could not serialize access".to_string()),
        ));
        assert!(serialization.is_conflict());
        for message in [
            "canceling statement due to lock timeout",
            "Lock wait timeout exceeded; try restarting transaction",
            "database is locked",
        ] {
            let err = database_error(message);
            assert!(err.is_retryable() && !err.is_conflict(), "{message:?}");
        }
    }

    #[test]
    fn lost_connections_are_outcome_unknown_whatever_the_capitals() {
        for message in [
            "MySQL server has gone away",
            "Server has gone away",
            "Lost connection to MySQL server during query",
            "Lost connection to server during query",
            "Lost connection to MySQL server at 'reading initial communication packet', system error: 104",
            "Connection was killed",
            "Server shutdown in progress",
            "The client was disconnected by the server because of inactivity. See wait_timeout and interactive_timeout for configuring this behavior.",
            "server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally",
            "terminating connection due to administrator command",
            "no connection to the server\n",
            "could not receive data from server: Connection reset by peer",
        ] {
            let err = database_error(message);
            assert!(err.is_outcome_unknown(), "{message:?}");
            assert!(!err.is_retryable(), "{message:?}");
        }
    }

    #[test]
    fn other_errors_are_not_outcome_unknown() {
        for message in [
            "Duplicate entry 'x' for key 'PRIMARY'",
            "Query execution was interrupted",
            "Deadlock found when trying to get lock; try restarting transaction",
            "relation \"tenure_jobs\" does not exist",
        ] {
            assert!(!database_error(message).is_outcome_unknown(), "{message:?}");
        }
        assert!(!Error::Timeout { what: "x" }.is_outcome_unknown());
    }
}

//! Transactions of the right kind per backend ([`transaction`], and the bare write
//! transactions tenure's own operations open), the guard for operations that need a bare
//! connection, SQLite writers' turns, and retries of transient errors. Below everything that
//! writes: the backend files use it too.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use diesel::connection::TransactionManager;
use diesel::result::Error as DieselError;

use crate::backend::turns::Turn;
use crate::backend::{Dialect, dispatch};
use crate::{Error, Result, TenureConnection};

/// Runs `f` in a transaction of the kind tenure's writes need on this backend, and commits it if
/// `f` returns `Ok` (rolls back otherwise).
///
/// - SQLite: `BEGIN IMMEDIATE`, so the transaction holds the write lock from its start and
///   cannot fail half-way with `SQLITE_BUSY` when it first writes (a deferred transaction can).
/// - PostgreSQL: `BEGIN ISOLATION LEVEL READ COMMITTED`, whatever the session's default.
/// - MySQL/MariaDB: READ COMMITTED for this one transaction, which locks only the rows a
///   statement touches (REPEATABLE READ also locks gaps between index entries and deadlocks
///   concurrent claimers; see the crate docs).
///
/// Inside a transaction that is already open, `f` runs in a savepoint of it instead.
///
/// On SQLite, the writers of one process take turns, first come first served, per database
/// file: a transaction waits for its turn (at most the connection's busy timeout) before it
/// asks for the write lock, and gives the turn back when it ends. So a busy process cannot
/// starve one of its own writers, which SQLite's busy handler alone allows.
///
/// Use it for your own writes that go with tenure calls which accept a caller's transaction
/// (enqueue, complete-in-transaction, verifying a lease).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use diesel::RunQueryDsl;
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// let n = tenure::transaction(&mut conn, |conn| {
///     diesel::sql_query("CREATE TABLE t (x INTEGER)").execute(conn)?;
///     diesel::sql_query("INSERT INTO t VALUES (1)").execute(conn)
/// })?;
/// assert_eq!(n, 1);
/// # Ok(()) }
/// ```
pub fn transaction<C, T, E, F>(conn: &mut C, f: F) -> std::result::Result<T, E>
where
    C: TenureConnection,
    E: From<DieselError>,
    F: FnOnce(&mut C) -> std::result::Result<T, E>,
{
    // The caller's error stays the caller's, even when a cluster rolled the transaction back.
    run(conn, f, |err| err)
}

/// [`transaction`] for tenure's own operations: an error after which the server no longer has
/// the transaction open (a Galera node rolled it back under it, and reported that as some
/// other error: a duplicate key, a trigger it could not load) is
/// [`Error::RolledBackUnderUs`], which the caller may repeat, not the error the server sent.
pub(crate) fn own_transaction<C, T, F>(conn: &mut C, f: F) -> Result<T>
where
    C: TenureConnection,
    F: FnOnce(&mut C) -> Result<T>,
{
    let outcome = run(conn, f, own_error_ended_under_us);
    dispatch!(any conn, c => undisguised(c, outcome))
}

/// The outcome of a transaction of tenure's, rolled back by now if it failed: a Galera abort
/// reported as a trigger's error is `RolledBackUnderUs`, once the node has been asked to load
/// the table's triggers again (`Dialect::recover_from_disguised_abort`).
fn undisguised<D: Dialect, T>(conn: &mut D, outcome: Result<T>) -> Result<T> {
    match outcome {
        Err(err) if conn.recover_from_disguised_abort(&err) => Err(Error::RolledBackUnderUs {
            operation: "a transaction",
        }),
        other => other,
    }
}

/// A transaction of tenure's that the server ended under an error is repeatable, whatever the
/// error said (a lost connection excepted: then its outcome is unknown). Also an answer tenure
/// derived from a database error (a duplicate key read as "a live job has this dedup key", or
/// as "stored meanwhile"): a Galera node reports its abort of the transaction so at times.
fn own_error_ended_under_us(err: Error) -> Error {
    match err {
        Error::Database(_) | Error::InvalidInput { .. } | Error::ClaimLost { .. }
            if !err.is_retryable() && !err.is_outcome_unknown() =>
        {
            tracing::debug!(error = %err, "the transaction ended under this error; repeatable");
            Error::RolledBackUnderUs {
                operation: "a transaction",
            }
        }
        other => other,
    }
}

fn run<C, T, E, F>(
    conn: &mut C,
    f: F,
    ended_under_us: impl FnOnce(E) -> E,
) -> std::result::Result<T, E>
where
    C: TenureConnection,
    E: From<DieselError>,
    F: FnOnce(&mut C) -> std::result::Result<T, E>,
{
    // Held until the transaction has ended (None inside a caller's transaction).
    let _turn = dispatch!(conn, c => c.write_turn())?;
    match dispatch!(conn, c => c.begin_write()) {
        Ok(()) => {}
        // Inside the caller's transaction: a savepoint.
        Err(DieselError::AlreadyInTransaction) => dispatch!(conn, c => begin_nested(c))?,
        Err(e) => return Err(e.into()),
    }
    let outcome = catch_unwind(AssertUnwindSafe(|| f(conn)));
    match outcome {
        Ok(outcome) => dispatch!(any conn, c => finish(c, outcome, ended_under_us)),
        Err(panic) => {
            // A panic the caller catches must not leave the transaction open on a connection
            // it keeps (its next transaction would be a savepoint of it, committing nothing;
            // on SQLite it would keep the write lock): roll back, then go on unwinding.
            let _ = dispatch!(conn, c => rollback_after_panic(c));
            resume_unwind(panic)
        }
    }
}

/// The error of a transaction the server ended before its commit: a serialization failure
/// (retryable), as Galera reports the aborts it does report.
fn ended_before_commit_error() -> DieselError {
    DieselError::DatabaseError(
        diesel::result::DatabaseErrorKind::SerializationFailure,
        Box::new(String::from(
            "the server rolled the transaction back before its commit (a cluster's abort)",
        )),
    )
}

/// Whether the transaction (not a savepoint of it) is the one about to end.
fn is_outermost<D: Dialect>(conn: &mut D) -> bool {
    D::TransactionManager::transaction_manager_status_mut(conn)
        .transaction_depth()
        .is_ok_and(|depth| depth.is_some_and(|d| d.get() == 1))
}

fn rollback_after_panic<D: Dialect>(conn: &mut D) -> diesel::QueryResult<()> {
    D::TransactionManager::rollback_transaction(conn)
}

fn begin_nested<D: Dialect>(conn: &mut D) -> diesel::QueryResult<()> {
    D::TransactionManager::begin_transaction(conn)
}

/// Commits after `Ok` and rolls back after `Err`, like diesel's own `transaction`, for a
/// transaction (or savepoint) that tenure began. An `Err` after which the server says no
/// transaction is open any more (only a cluster does that: see
/// `Dialect::transaction_ended_under_us`) goes through `ended_under_us`.
fn finish<D, T, E>(
    conn: &mut D,
    outcome: std::result::Result<T, E>,
    ended_under_us: impl FnOnce(E) -> E,
) -> std::result::Result<T, E>
where
    D: Dialect,
    E: From<DieselError>,
{
    match outcome {
        Ok(value) => {
            if is_outermost(conn) {
                // COMMIT with no transaction open succeeds, committing nothing: answering Ok
                // would acknowledge writes the server threw away. The question's own error is
                // the abort's, when the server reports it (then it must not be lost either).
                // Diesel's state is reset by a ROLLBACK, which may find nothing to roll back.
                let ended = match conn.ended_before_commit() {
                    Ok(false) => None,
                    Ok(true) => Some(ended_before_commit_error()),
                    Err(e) => Some(e),
                };
                if let Some(error) = ended {
                    let err = ended_under_us(E::from(error));
                    let _ = D::TransactionManager::rollback_transaction(conn);
                    return Err(err);
                }
            }
            D::TransactionManager::commit_transaction(conn)?;
            Ok(value)
        }
        Err(err) => {
            let ended = conn.transaction_ended_under_us();
            let err = if ended { ended_under_us(err) } else { err };
            match D::TransactionManager::rollback_transaction(conn) {
                Ok(()) | Err(DieselError::BrokenTransactionManager) => Err(err),
                // Nothing was left to roll back (a savepoint of a transaction that is gone).
                Err(_) if ended => Err(err),
                Err(rollback_error) => Err(rollback_error.into()),
            }
        }
    }
}

/// Runs `f` in a write transaction of tenure's kind on a connection that must not be inside a
/// caller's transaction (the operations that need a bare connection use this).
pub(crate) fn bare_write_transaction<D, T, F>(
    conn: &mut D,
    operation: &'static str,
    f: F,
) -> Result<T>
where
    D: Dialect,
    F: FnOnce(&mut D) -> Result<T>,
{
    // Held until the transaction has ended (None inside a caller's transaction, which
    // `begin_bare` then refuses).
    let _turn = conn.write_turn()?;
    begin_bare(conn, operation)?;
    match catch_unwind(AssertUnwindSafe(|| f(conn))) {
        Ok(outcome) => {
            let outcome = finish(conn, outcome, own_error_ended_under_us);
            undisguised(conn, outcome)
        }
        Err(panic) => {
            let _ = rollback_after_panic(conn);
            resume_unwind(panic)
        }
    }
}

/// For a single write statement that may run on a bare connection (autocommit): this
/// process's turn to write on SQLite, held by the caller until the statement is done. `None`
/// on the servers and inside a transaction.
pub(crate) fn write_turn<C: TenureConnection>(conn: &mut C) -> Result<Option<Turn>> {
    Ok(dispatch!(conn, c => c.write_turn())?)
}

/// Begins tenure's write transaction, or says [`Error::InTransaction`] if the caller has one open.
pub(crate) fn begin_bare<D: Dialect>(conn: &mut D, operation: &'static str) -> Result<()> {
    match conn.begin_write() {
        Ok(()) => Ok(()),
        Err(DieselError::AlreadyInTransaction) => Err(Error::InTransaction { operation }),
        Err(e) => Err(e.into()),
    }
}

/// Fails with [`Error::InTransaction`] if the caller has a transaction open on `conn`, for the
/// operations that cannot run inside one and do not open one themselves either (migrations on
/// MySQL, whose DDL commits implicitly). Costs an empty transaction.
#[cfg_attr(not(feature = "mysql"), allow(dead_code))]
pub(crate) fn require_bare<D: Dialect>(conn: &mut D, operation: &'static str) -> Result<()> {
    match diesel::connection::AnsiTransactionManager::begin_transaction_sql(conn, "BEGIN") {
        Ok(()) => Ok(D::TransactionManager::commit_transaction(conn)?),
        Err(DieselError::AlreadyInTransaction) => Err(Error::InTransaction { operation }),
        Err(e) => Err(e.into()),
    }
}

/// How long a transaction tenure owns keeps being tried again after deadlocks or
/// serialization failures (at least [`TRANSIENT_RETRIES_AT_LEAST`] times; a wait that ran
/// out, a lock timeout or SQLite's busy timeout, is tried that many times only: its length
/// is the caller's setting, not to be multiplied without end). Counted in time, not tries:
/// InnoDB rolls back the transaction that wrote least, so a finish of a keyed job lost every
/// deadlock with a stream of keyed bulks into its queue (the finish's move of the job's key
/// out of the unique index needs the gap before the queue's first key, which each bulk locks
/// while it waits for the finished job's key); six tries in 130 ms all lost.
const TRANSIENT_RETRY_BUDGET: std::time::Duration = std::time::Duration::from_secs(5);
/// The fewest tries after a transient conflict, however long each took (PostgreSQL reports a
/// deadlock only after its `deadlock_timeout`, a second by default).
const TRANSIENT_RETRIES_AT_LEAST: u32 = 6;
/// The longest pause between two tries, in milliseconds.
const TRANSIENT_PAUSE_MAX_MS: u64 = 100;

/// [`transaction`] for tenure's own operations whose locks can meet other transactions' in a
/// cycle (a finish settling dependents of lower id than a job it finishes, while a cancel or
/// an enqueue locks in id order): outside a caller's transaction, a deadlock, serialization
/// failure or busy database rolls the whole transaction back and it runs again (six
/// times, and after deadlocks for up to five seconds, after short random pauses), so it
/// reaches the caller only when the conflicts go on that long. Inside a caller's
/// transaction it runs once, and such an error is the caller's to retry
/// ([`Error::is_retryable`]).
pub(crate) fn retrying_transaction<C, T, F>(conn: &mut C, mut f: F) -> Result<T>
where
    C: TenureConnection,
    F: FnMut(&mut C) -> Result<T>,
{
    if in_transaction(conn) {
        return own_transaction(conn, f);
    }
    retry_transient(|| own_transaction(conn, &mut f))
}

/// Runs `attempt` (a whole transaction tenure owns) again after a deadlock, serialization
/// failure or busy database, [`TRANSIENT_RETRIES_AT_LEAST`] times, and after deadlocks and
/// serialization failures for up to [`TRANSIENT_RETRY_BUDGET`], after short random pauses.
pub(crate) fn retry_transient<T>(mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
    let started = std::time::Instant::now();
    let mut tries = 0;
    loop {
        match attempt() {
            // Retryable, but on another connection: this one will refuse every try.
            Err(e @ Error::Database(DieselError::BrokenTransactionManager)) => return Err(e),
            Err(e @ (Error::Database(_) | Error::RolledBackUnderUs { .. }))
                if e.is_retryable()
                    && (tries < TRANSIENT_RETRIES_AT_LEAST
                        || (e.is_conflict() && started.elapsed() < TRANSIENT_RETRY_BUDGET)) =>
            {
                tries += 1;
                tracing::debug!(error = %e, tries, "a transient conflict; running the transaction again");
                // Growing, capped, and drawn at random within its range, so that two
                // transactions that met once do not meet again in step.
                let ceiling = 2u64.pow(tries.min(7)).min(TRANSIENT_PAUSE_MAX_MS);
                let pause = rand::random_range(ceiling / 2..=ceiling + 4);
                std::thread::sleep(std::time::Duration::from_millis(pause));
            }
            other => return other,
        }
    }
}

/// Whether the connection is inside a transaction (the caller's, or one tenure began).
pub(crate) fn in_transaction<C: TenureConnection>(conn: &mut C) -> bool {
    dispatch!(any conn, c => depth_of(c))
}

fn depth_of<D: Dialect>(conn: &mut D) -> bool {
    D::TransactionManager::transaction_manager_status_mut(conn)
        .transaction_depth()
        .map_or(true, |depth| depth.is_some())
}

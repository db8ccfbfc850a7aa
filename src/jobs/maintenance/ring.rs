//! Reclaiming the ready ring (PostgreSQL and MySQL/MariaDB; docs/storage-design.md): claims
//! read waiting jobs from `tenure_ready`, three partitions ("slots") kept exact by triggers on
//! `tenure_jobs`. A claim deletes the entries it takes, and while another transaction holds
//! an old snapshot (a read view) neither vacuum nor purge can remove them, so each rotation
//! empties the slot that new entries go to next by `TRUNCATE`, which needs neither and
//! ignores snapshots. Entries still waiting in it (a backlog, jobs due later) move to the
//! current slot first, under a lock no other writer of the ring holds: a truncate never
//! removes a waiting job's entry.
//!
//! SQLite claims from `tenure_jobs` itself (one writer, no snapshot held across processes):
//! a rotation does nothing there.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::BigInt;

use crate::backend::dispatch;
use crate::{Result, TenureConnection};

/// How many times a rotation tries for the slot's exclusive lock (`NOWAIT`: a rotation
/// never queues claims behind it) before it gives up until the next call.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const LOCK_TRIES: u32 = 10;

/// How many waiting entries a rotation moves at most: more (a backlog) would hold every
/// claim behind its lock for as long, so the ring waits until claims have taken them (the
/// backlog's oldest entries are the first claimed). PostgreSQL's is in its migration.
#[cfg(feature = "mysql")]
const MAX_MOVED: i64 = 2000;

/// MariaDB rotates (with a nonzero interval) only while InnoDB's history list, the undo
/// that purge has not removed, holds more than this many transactions: a read view is held
/// open, or purge has fallen behind, and delete-marked entries pile up in the ring. While
/// purge keeps up it removes them itself, and a truncate would only make older REPEATABLE
/// READ transactions that change a waiting job fail (1412, retryable). A clean run of
/// bench G at 1,000 jobs/s keeps the list at a few hundred; a held read view passes this
/// within seconds.
#[cfg(feature = "mysql")]
const PURGE_LAG: i64 = 5_000;

/// Whether a zero interval forces a rotation whatever the history list says (see
/// [`rotate_ready`]); with a nonzero one, MariaDB rotates only while purge lags, or when the
/// server does not report the list (a MySQL-family server without the status variable).
#[cfg(feature = "mysql")]
fn purge_lets_rotate(min_interval_micros: i64, history: Option<i64>) -> bool {
    min_interval_micros == 0 || history.is_none_or(|length| length > PURGE_LAG)
}

/// One rotation, if due (the migration's `tenure_rotate_ready`: it runs as the owner who
/// migrated, so that an application user with row privileges alone may rotate). Returns the
/// entries moved, -1 when not due or another rotation runs, -2 when the slot is busy, -3
/// when more than 2,000 entries wait in it (moving them would hold claims up as long).
#[cfg(feature = "postgres")]
const ROTATE: &str = "SELECT tenure_rotate_ready(?) AS n";

#[derive(QueryableByName)]
#[cfg(any(feature = "postgres", feature = "mysql"))]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Empties the ready ring's oldest slot and moves the ring on, if its last rotation is at
/// least `min_interval` old by the database's clock. Returns how many waiting jobs' entries
/// moved to the current slot, or `None` when nothing was done: not due yet, another rotation
/// running, the slot busy (a transaction still uses it: tried again at the next call), more
/// than 2,000 jobs still waiting in it (a backlog: the ring waits for claims to take them
/// rather than hold every claim while it moves them), or a backend without a ring (SQLite).
/// A worker calls it every second; a program that claims without a worker
/// ([`crate::jobs::claim`]) should too, from one place (any number of callers is safe: one
/// rotation at a time, the others return `None`). Needs a bare connection. A
/// `min_interval` longer than [`crate::MAX_TTL`] is [`crate::Error::InvalidInput`].
///
/// On MySQL/MariaDB a rotation takes a table lock (`LOCK TABLES`, with `NOWAIT`) and
/// truncates a partition: the connection's user needs the `LOCK TABLES` and `DROP`
/// privileges (the least-privileged user of docs/guide.md has neither: then this is an
/// error, and the ring is reclaimed by purge alone, as `tenure_jobs` always was). The
/// history list is read from the server's status (`Innodb_history_list_length`), which
/// needs no privilege.
/// A REPEATABLE READ transaction whose read view is older than a truncate, and that then
/// changes a waiting job (a cancel, a replacing duplicate), fails with 1412 "Table
/// definition has changed", which [`crate::Error::is_retryable`] says to repeat; so
/// MariaDB rotates only while purge lags (InnoDB's history list over 5,000: a read view
/// held open), or whatever it says when `min_interval` is zero.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// // SQLite has no ring: nothing to reclaim.
/// assert_eq!(tenure::jobs::rotate_ready(&mut conn, Duration::from_secs(1))?, None);
/// # Ok(()) }
/// ```
pub fn rotate_ready<C: TenureConnection>(
    conn: &mut C,
    min_interval: Duration,
) -> Result<Option<u64>> {
    if min_interval > crate::MAX_TTL {
        return Err(crate::Error::invalid(
            "min_interval",
            format!(
                "{min_interval:?} is longer than {} days",
                crate::MAX_TTL.as_secs() / 86400
            ),
        ));
    }
    let micros = i64::try_from(min_interval.as_micros())
        .map_err(|_| crate::Error::invalid("min_interval", "too long"))?;
    dispatch!(conn, c => c.rotate(micros))
}

/// The rotation, per backend: the servers' rings; nothing where claims read `tenure_jobs`.
trait ReadyRing {
    /// One rotation if due (see [`rotate_ready`]).
    fn rotate(&mut self, _min_interval_micros: i64) -> Result<Option<u64>> {
        Ok(None)
    }
}

#[cfg(feature = "sqlite")]
impl ReadyRing for diesel::sqlite::SqliteConnection {}

#[cfg(feature = "postgres")]
impl ReadyRing for diesel::pg::PgConnection {
    fn rotate(&mut self, micros: i64) -> Result<Option<u64>> {
        use crate::backend::statement::statement;
        use crate::backend::transaction::bare_write_transaction;
        for attempt in 1..=LOCK_TRIES {
            let moved = bare_write_transaction(self, "rotate_ready", |c| {
                Ok(statement(ROTATE)
                    .bind::<BigInt, _>(micros)
                    .get_result::<N>(c)?
                    .n)
            })?;
            match moved {
                // The slot is busy: a little later.
                -2 if attempt < LOCK_TRIES => std::thread::sleep(Duration::from_millis(2)),
                n => return Ok(u64::try_from(n).ok()),
            }
        }
        Ok(None)
    }
}

/// MariaDB's rotation, statement by statement on the bare connection (a table lock cannot
/// be taken in a stored routine, and a batch of statements that `KILL QUERY` interrupts
/// left the client waiting for a result the server never sent). `LOCK TABLES ... WRITE
/// NOWAIT` is granted only when no open transaction has used the ring (a claim, or any
/// statement on `tenure_jobs`, whose triggers hold the ring's metadata lock until it ends),
/// and never waits in the queue where claims would wait behind it. Under it this connection
/// alone reads and writes the ring: everything still in the oldest slot moves to the
/// current one, the slot is truncated, and the generation moves on unless another rotation
/// moved it meanwhile. That is safe whatever the generation (what the truncate removes was
/// moved first), so each statement commits on its own: a rotation stopped after any of them
/// leaves the ring exact, and the next does the rest. While it holds the lock, its session
/// waits at most [`mysql::STALLED`] for its next statement: a client stopped or cut off
/// between two of them loses its connection, and its lock, instead of holding every claim
/// for the server's `wait_timeout` (hours).
#[cfg(feature = "mysql")]
mod mysql {
    /// The generation, and whether a rotation is due by the database's clock (UTC, as all
    /// of tenure's instants: `NOW()` follows the session's time zone). No row: the
    /// migration's row is gone.
    pub(super) const DUE: &str = "SELECT generation AS n, \
        CAST(rotated_at + INTERVAL ? MICROSECOND <= UTC_TIMESTAMP(6) AS SIGNED) AS due \
        FROM tenure_ready_ring WHERE one = 1";
    /// How many entries (at most `?`) the slot `?` holds.
    pub(super) const WAITING: &str =
        "SELECT COUNT(*) AS n FROM (SELECT 1 FROM tenure_ready WHERE slot = ? LIMIT ?) AS waiting";
    /// Seconds the rotating session waits for its client's next statement.
    pub(super) const STALLED: &str = "SET SESSION wait_timeout = 2";
    pub(super) const UNSTALLED: &str = "SET SESSION wait_timeout = DEFAULT";
    pub(super) const LOCK: &str = "LOCK TABLES tenure_ready WRITE, tenure_ready_ring WRITE NOWAIT";
    pub(super) const MOVE: &str = "UPDATE tenure_ready SET slot = ? WHERE slot = ?";
    /// By slot (a partition's name is not a value a statement can bind).
    pub(super) const TRUNCATE: [&str; 3] = [
        "ALTER TABLE tenure_ready TRUNCATE PARTITION p0",
        "ALTER TABLE tenure_ready TRUNCATE PARTITION p1",
        "ALTER TABLE tenure_ready TRUNCATE PARTITION p2",
    ];
    pub(super) const ADVANCE: &str = "UPDATE tenure_ready_ring \
        SET generation = generation + 1, rotated_at = UTC_TIMESTAMP(6) \
        WHERE one = 1 AND generation = ?";
    pub(super) const UNLOCK: &str = "UNLOCK TABLES";
    /// InnoDB's history list length (undo purge has not yet removed): a status variable,
    /// which any user may read (`INNODB_METRICS` needs PROCESS, and names its columns
    /// differently on MySQL and MariaDB). No row: the server does not report it.
    pub(super) const HISTORY: &str = "SELECT CAST(VARIABLE_VALUE AS SIGNED) AS n \
        FROM information_schema.GLOBAL_STATUS \
        WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'";

    #[derive(diesel::QueryableByName)]
    pub(super) struct Due {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub(super) n: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub(super) due: i64,
    }
}

#[cfg(feature = "mysql")]
impl ReadyRing for diesel::mysql::MysqlConnection {
    fn rotate(&mut self, micros: i64) -> Result<Option<u64>> {
        use diesel::connection::{SimpleConnection, TransactionManager};
        use diesel::sql_types::SmallInt;

        use crate::backend::statement::statement;
        use crate::backend::transaction::in_transaction;
        // LOCK TABLES would commit the caller's transaction half-way.
        if in_transaction(self) {
            return Err(crate::Error::InTransaction {
                operation: "rotate_ready",
            });
        }
        let ring = statement(mysql::DUE)
            .bind::<BigInt, _>(micros)
            .get_result::<mysql::Due>(self)
            .optional()?
            .ok_or_else(|| {
                crate::Error::Migration(
                    "tenure_ready_ring has no row: the ready ring cannot rotate (run the \
                     migrations again, or restore the row the migration wrote)"
                        .to_string(),
                )
            })?;
        if ring.due == 0 {
            return Ok(None);
        }
        // An error here is an error (a failing read taken as "unknown" would rotate every
        // second, hiding what broke).
        let history = statement(mysql::HISTORY)
            .get_result::<N>(self)
            .optional()?
            .map(|row| row.n);
        if !purge_lets_rotate(micros, history) {
            return Ok(None);
        }
        // On a Galera node LOCK TABLES is the node's own, and holding it kept the node from
        // applying the other nodes' writes to the ring: every node's commits waited, for good
        // (`clusters::galera_across_nodes`). There the ring is reclaimed by purge alone, as
        // tenure_jobs is.
        if crate::backend::mysql::in_galera_cluster(self)? {
            return Ok(None);
        }
        let current = i16::try_from(ring.n.rem_euclid(3)).unwrap_or(0);
        let oldest = (current + 1) % 3;
        // Counted before the lock: what the rotation moves (a backlog's slot is left for
        // claims to empty; only a writer with an old read view adds to the oldest slot).
        let waiting = statement(mysql::WAITING)
            .bind::<SmallInt, _>(oldest)
            .bind::<BigInt, _>(MAX_MOVED + 1)
            .get_result::<N>(self)?
            .n;
        if waiting > MAX_MOVED {
            return Ok(None);
        }
        self.batch_execute(mysql::STALLED)?;
        let mut locked = Ok(false);
        for attempt in 1..=LOCK_TRIES {
            locked = match self.batch_execute(mysql::LOCK) {
                Ok(()) => Ok(true),
                // Another transaction uses the ring: a little later, or at the next call.
                Err(e) if is_lock_refused(&e) => Ok(false),
                Err(e) => Err(e),
            };
            if !matches!(locked, Ok(false)) {
                break;
            }
            if attempt < LOCK_TRIES {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let rotated = match locked {
            Ok(true) => (|| -> Result<Option<u64>> {
                let moved = statement(mysql::MOVE)
                    .bind::<SmallInt, _>(current)
                    .bind::<SmallInt, _>(oldest)
                    .execute(self)?;
                let truncate = mysql::TRUNCATE[usize::try_from(oldest).unwrap_or(0)];
                self.batch_execute(truncate)?;
                statement(mysql::ADVANCE)
                    .bind::<BigInt, _>(ring.n)
                    .execute(self)?;
                Ok(u64::try_from(moved).ok())
            })(),
            Ok(false) => Ok(None),
            Err(e) => Err(e.into()),
        };
        // Whatever happened (an interrupted statement included: `KILL QUERY` may land on
        // any of these), no connection goes back to a pool holding the ring's lock, which
        // would stop every claim, nor waiting two seconds for its next statement: tried a
        // few times, else the connection is marked broken, which a pool discards.
        let tidied = (0..10).any(|try_number| {
            if try_number > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.batch_execute(mysql::UNLOCK).is_ok()
        }) && (0..10).any(|_| self.batch_execute(mysql::UNSTALLED).is_ok());
        if !tidied {
            <Self as diesel::Connection>::TransactionManager::transaction_manager_status_mut(self)
                .set_in_error();
        }
        rotated
    }
}

/// MariaDB refused `LOCK TABLES ... NOWAIT` (1205): another transaction uses the ring.
#[cfg(feature = "mysql")]
fn is_lock_refused(error: &diesel::result::Error) -> bool {
    matches!(error, diesel::result::Error::DatabaseError(_, info)
        if info.message().contains("Lock wait timeout exceeded"))
}

#[cfg(all(test, feature = "mysql"))]
mod tests {
    use super::{PURGE_LAG, purge_lets_rotate};

    #[test]
    fn mariadb_rotates_while_purge_lags_or_when_forced_or_unknown() {
        assert!(!purge_lets_rotate(1_000_000, Some(300)), "purge keeps up");
        assert!(!purge_lets_rotate(1_000_000, Some(PURGE_LAG)));
        assert!(
            purge_lets_rotate(1_000_000, Some(PURGE_LAG + 1)),
            "purge lags"
        );
        assert!(purge_lets_rotate(1_000_000, None), "the list unreadable");
        assert!(purge_lets_rotate(0, Some(0)), "a zero interval forces it");
    }
}

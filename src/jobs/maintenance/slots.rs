//! Reclaiming finished jobs' space by whole slots (PostgreSQL; docs/storage-design.md, "What
//! the records' step built"): `tenure_jobs` is partitioned into six slots that new jobs fill
//! in turn, and `kept` for jobs with a dedup key. Retention deletes finished jobs one by one;
//! their dead row versions stay in the slot (vacuum cannot remove them while any transaction
//! holds an older snapshot, and without autovacuum nothing ever does) until the slot holds no
//! job at all, when a rotation truncates it and makes it a place for new jobs again. A job
//! never moves: a slot with a job still in it (waiting, running, kept by retention) waits,
//! and the others go on turning, so one job that runs for hours holds back one slot's space,
//! never the rest.
//!
//! MySQL/MariaDB and SQLite keep one table: a rotation does nothing there.

use std::time::Duration;

use crate::backend::dispatch;
use crate::{Result, TenureConnection};

/// Truncates the first slot of `tenure_jobs` after the current one that holds no job, and
/// moves new jobs on to it, if the last rotation is at least `min_interval` old by the
/// database's clock. Returns the slot new jobs now go to, or `None` when nothing turned: not
/// due yet, another rotation running, every other slot still holding a job, the slot's lock
/// not granted (ten tries, from 5 ms to 100 ms each), or a backend without slots
/// (MySQL/MariaDB, SQLite). A worker calls it every second with a five-second
/// interval (after its prunes: a slot empties when retention has deleted its last job); a
/// program that prunes without a worker ([`crate::jobs::prune`]) should call it too, from
/// anywhere (any number of callers is safe: one rotation at a time, the others return
/// `None`). The slot is locked, waiting 5 ms at first and up to 100 ms on the last tries
/// (statements on `tenure_jobs` wait behind that wait, never longer), and checked empty under its lock: a transaction that
/// has used `tenure_jobs` and is still open (a report, say) keeps the slots from turning
/// until it ends, never a claim waiting. Needs a bare connection. A `min_interval`
/// longer than [`crate::MAX_TTL`] is [`crate::Error::InvalidInput`].
///
/// A transaction that read a job before its slot was truncated, under a snapshot taken
/// before (REPEATABLE READ or SERIALIZABLE), no longer sees it afterwards: only jobs that
/// retention had deleted are in a slot truncated, so what such a reader misses is what it
/// would have seen deleted had it started later.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// // SQLite keeps one table: nothing to turn.
/// assert_eq!(tenure::jobs::rotate_job_slots(&mut conn, Duration::from_secs(5))?, None);
/// # Ok(()) }
/// ```
pub fn rotate_job_slots<C: TenureConnection>(
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
    dispatch!(conn, c => c.rotate_slots(micros))
}

/// How long each try waits for a slot's lock, in milliseconds. Statements on `tenure_jobs`
/// that arrive during a wait queue behind it, so the first tries are short; under load
/// (every claim transaction slower than the wait, so the lock is never free in time: a
/// suite running at load 10 saw no rotation in three seconds with 5 ms tries alone) the
/// later ones wait longer, at most 100 ms once in a rotation's interval.
#[cfg(feature = "postgres")]
const LOCK_WAITS_MS: [i32; 10] = [5, 5, 10, 10, 20, 20, 50, 50, 100, 100];

/// The rotation, per backend: PostgreSQL's slots; nothing where `tenure_jobs` is one table.
trait JobSlots {
    /// One rotation if due (see [`rotate_job_slots`]).
    fn rotate_slots(&mut self, _min_interval_micros: i64) -> Result<Option<u64>> {
        Ok(None)
    }
}

#[cfg(feature = "sqlite")]
impl JobSlots for diesel::sqlite::SqliteConnection {}

#[cfg(feature = "mysql")]
impl JobSlots for diesel::mysql::MysqlConnection {}

#[cfg(feature = "postgres")]
impl JobSlots for diesel::pg::PgConnection {
    fn rotate_slots(&mut self, micros: i64) -> Result<Option<u64>> {
        use diesel::prelude::*;
        use diesel::sql_types::BigInt;

        use crate::backend::statement::statement;
        use crate::backend::transaction::bare_write_transaction;

        #[derive(QueryableByName)]
        struct Slot {
            #[diesel(sql_type = BigInt)]
            slot: i64,
        }
        // The migration's `tenure_rotate_job_slots` (it runs as the owner who migrated: an
        // application user with row privileges alone may rotate): the new current slot, -1
        // when not due or another rotation runs, -2 when the slot's lock was not granted in
        // the wait given (tried again a little later, each try waiting a little longer:
        // statements on tenure_jobs queue behind the wait, never longer), -3 when no other
        // slot was empty.
        let mut slot = -2;
        for wait in LOCK_WAITS_MS {
            slot = bare_write_transaction(self, "rotate_job_slots", |c| {
                Ok(statement("SELECT tenure_rotate_job_slots(?, ?) AS slot")
                    .bind::<BigInt, _>(micros)
                    .bind::<diesel::sql_types::Integer, _>(wait)
                    .get_result::<Slot>(c)?
                    .slot)
            })?;
            if slot != -2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(u64::try_from(slot).ok())
    }
}

//! Reclaiming the ready ring (PostgreSQL; docs/storage-design.md): claims read waiting jobs
//! from `tenure_ready`, three partitions ("slots") kept exact by triggers on `tenure_jobs`.
//! A claim deletes the entries it takes, and while another transaction holds an old snapshot
//! vacuum cannot remove them, so each rotation empties the slot that new entries go to next
//! by `TRUNCATE`, which needs no vacuum and ignores snapshots. Entries still waiting in it
//! (a backlog, jobs due later) move to the current slot first, in the same transaction,
//! under the slot's exclusive lock: a truncate never removes a waiting job's entry.
//!
//! SQLite and MySQL/MariaDB claim from `tenure_jobs` itself (no ring yet: a rotation does
//! nothing there).

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::BigInt;

use crate::backend::dispatch;
use crate::{Result, TenureConnection};

/// How many times a rotation tries for the slot's exclusive lock (`NOWAIT`: a rotation
/// never queues claims behind it) before it gives up until the next call.
#[cfg(feature = "postgres")]
const LOCK_TRIES: u32 = 10;

/// One rotation, if due (the migration's `tenure_rotate_ready`: it runs as the owner who
/// migrated, so that an application user with row privileges alone may rotate). Returns the
/// entries moved, -1 when not due or another rotation runs, -2 when the slot is busy, -3
/// when more than 2,000 entries wait in it (moving them would hold claims up as long).
#[cfg(feature = "postgres")]
const ROTATE: &str = "SELECT tenure_rotate_ready(?) AS n";

#[derive(QueryableByName)]
#[cfg(feature = "postgres")]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Empties the ready ring's oldest slot and moves the ring on, if its last rotation is at
/// least `min_interval` old by the database's clock. Returns how many waiting jobs' entries
/// moved to the current slot, or `None` when nothing was done: not due yet, another rotation
/// running, the slot busy (a transaction still uses it: tried again at the next call), more
/// than 2,000 jobs still waiting in it (a backlog: the ring waits for claims to take them
/// rather than hold every claim while it moves them), or a backend without a ring (SQLite,
/// MySQL/MariaDB). A worker calls it every second; a
/// program that claims without a worker ([`crate::jobs::claim`]) should too, from one place
/// (any number of callers is safe: one rotation at a time, the others return `None`).
/// Needs a bare connection. A `min_interval` longer than [`crate::MAX_TTL`] is
/// [`crate::Error::InvalidInput`].
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

/// The rotation, per backend: PostgreSQL's ring; nothing where claims read `tenure_jobs`.
trait ReadyRing {
    /// One rotation if due (see [`rotate_ready`]).
    fn rotate(&mut self, _min_interval_micros: i64) -> Result<Option<u64>> {
        Ok(None)
    }
}

#[cfg(feature = "sqlite")]
impl ReadyRing for diesel::sqlite::SqliteConnection {}

#[cfg(feature = "mysql")]
impl ReadyRing for diesel::mysql::MysqlConnection {}

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

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

use chrono::{DateTime, Utc};

use crate::backend::dispatch;
use crate::jobs::maintenance::retention::policy_cutoff;
use crate::jobs::{Finished, Retention};
use crate::{Result, TenureConnection};

/// Truncates the first slot of `tenure_jobs` after the current one that holds no job, and
/// moves new jobs on to it, if the last rotation is at least `min_interval` old by the
/// database's clock. Returns the slot new jobs now go to, or `None` when nothing turned: not
/// due yet, backing off, another rotation running, every other slot still holding a job, the
/// slot's lock not granted (three tries `NOWAIT`, then one that waits 20 ms; when that fails
/// too, rotations back off for 100 ms, then twice as long each time, at most a minute), or a
/// backend without slots (MySQL/MariaDB, SQLite). A worker calls it every second with a five-second
/// interval (after its prunes: a slot empties when retention has deleted its last job); a
/// program that prunes without a worker ([`crate::jobs::prune`]) should call it too, from
/// anywhere (any number of callers is safe: one rotation at a time, the others return
/// `None`). The slot is locked, waiting 20 ms at most (statements on `tenure_jobs` wait
/// behind that wait, never longer), and checked empty under its lock: a transaction that
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

/// Retention by slot (PostgreSQL): truncates each slot of `tenure_jobs` but the current one
/// whose jobs `policies` would all delete (finished, past their queue's policy for their
/// state, outside any dedup window, needed by no unfinished or dead dependent: what
/// [`crate::jobs::prune`] deletes), with their rows beside it (errors, outputs, results,
/// limits, steps, parks, dependencies, workflows left without a job), instead of deleting
/// them one by one. Returns how many slots it truncated and how many jobs of each queue went
/// with them (a worker reports them as [`Event::Pruned`](crate::events::Event::Pruned)). A slot holding one job the policies
/// keep (a queue without a policy here, a job still waiting or running) stays for the
/// prunes and a later call. Checked under the slot's exclusive lock (asked for as the
/// rotation asks, never waiting more than 20 ms), so a claim, a finish or a dependent's
/// enqueue that races it either came first, and is seen, or waits and finds the job gone.
/// Needs a bare connection. A worker calls it before each prune pass with its own policies;
/// a program that prunes without a worker may call it too. Nothing to do on
/// MySQL/MariaDB and SQLite (`Ok(0)`).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, Finished, Retention};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let policies = [("mail".to_string(), Finished::Completed, Retention::DeleteAll)];
/// assert_eq!(jobs::reclaim_job_slots(&mut conn, &policies)?.slots, 0);
/// # Ok(()) }
/// ```
pub fn reclaim_job_slots<C: TenureConnection>(
    conn: &mut C,
    policies: &[(String, Finished, Retention)],
) -> Result<ReclaimedSlots> {
    let mut reclaimed = ReclaimedSlots::default();
    if !dispatch!(any conn, c => crate::backend::Dialect::syntax(c).job_slots) {
        return Ok(reclaimed);
    }
    let mut queues = Vec::new();
    let mut states = Vec::new();
    let mut befores = Vec::new();
    for (queue, finished, policy) in policies {
        if let Some(before) = policy_cutoff(conn, queue, *finished, *policy)? {
            queues.push(queue.clone());
            states.push(finished.state().to_string());
            befores.push(before);
        }
    }
    if queues.is_empty() {
        return Ok(reclaimed);
    }
    // One slot a call, each in its own transaction: at most the five but the current one.
    for _ in 0..5 {
        match dispatch!(conn, c => c.reclaim_slot(&queues, &states, &befores))? {
            Some(jobs) => {
                reclaimed.slots += 1;
                for (queue, n) in jobs {
                    match reclaimed.jobs.iter_mut().find(|(q, _)| *q == queue) {
                        Some((_, total)) => *total += n,
                        None => reclaimed.jobs.push((queue, n)),
                    }
                }
            }
            None => break,
        }
    }
    Ok(reclaimed)
}

/// What [`reclaim_job_slots`] took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReclaimedSlots {
    /// The slots truncated.
    pub slots: usize,
    /// How many jobs of each queue went with them.
    pub jobs: Vec<(String, usize)>,
}

/// How long each try of a rotation waits for a slot's lock, in milliseconds (0: NOWAIT, which
/// queues nobody). Statements on `tenure_jobs` that arrive during a wait queue behind it, so
/// only the last try waits, and briefly; when it fails too, the next rotation backs off
/// (100 ms, doubling, at most a minute: a transaction that stays open holds the lock for its
/// whole length, and a worker trying each second with waits of 370 ms in all held claims up a
/// third of the time, as a helper's attack measured).
#[cfg(feature = "postgres")]
const LOCK_WAITS_MS: [i32; 4] = [0, 0, 0, 20];

/// The rotation, per backend: PostgreSQL's slots; nothing where `tenure_jobs` is one table.
trait JobSlots {
    /// One rotation if due (see [`rotate_job_slots`]).
    fn rotate_slots(&mut self, _min_interval_micros: i64) -> Result<Option<u64>> {
        Ok(None)
    }

    /// One slot's retention (see [`reclaim_job_slots`]): if a slot was truncated, how many
    /// jobs of each queue went with it.
    fn reclaim_slot(
        &mut self,
        _queues: &[String],
        _states: &[String],
        _befores: &[DateTime<Utc>],
    ) -> Result<Option<Vec<(String, usize)>>> {
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

        // The migration's `tenure_rotate_job_slots` (it runs as the owner who migrated: an
        // application user with row privileges alone may rotate): the new current slot, -1
        // when not due, backing off or another rotation runs, -2 when the slot's lock was not
        // granted (tried again a little later), -3 when no other slot was empty.
        let mut slot = -2;
        for wait in LOCK_WAITS_MS {
            slot = bare_write_transaction(self, "rotate_job_slots", |c| {
                Ok(statement("SELECT tenure_rotate_job_slots(?, ?) AS slot")
                    .bind::<BigInt, _>(micros)
                    .bind::<diesel::sql_types::Integer, _>(wait)
                    .get_result::<SlotRow>(c)?
                    .slot)
            })?;
            if slot != -2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(u64::try_from(slot).ok())
    }

    fn reclaim_slot(
        &mut self,
        queues: &[String],
        states: &[String],
        befores: &[DateTime<Utc>],
    ) -> Result<Option<Vec<(String, usize)>>> {
        use diesel::RunQueryDsl;
        use diesel::sql_types::{Array, Integer, Text, Timestamptz};

        use crate::backend::statement::statement;
        use crate::backend::transaction::bare_write_transaction;

        // The migration's `tenure_reclaim_job_slot`: the slot truncated with a row for each
        // queue of its jobs, or one row: -1 when a rotation or another reclaim runs, -2 when
        // the slot's lock was not granted, -3 when none may go.
        let mut rows = Vec::new();
        for wait in LOCK_WAITS_MS {
            rows = bare_write_transaction(self, "reclaim_job_slots", |c| {
                Ok(
                    statement("SELECT slot, queue, jobs FROM tenure_reclaim_job_slot(?, ?, ?, ?)")
                        .bind::<Array<Text>, _>(queues)
                        .bind::<Array<Text>, _>(states)
                        .bind::<Array<Timestamptz>, _>(befores)
                        .bind::<Integer, _>(wait)
                        .load::<ReclaimedRow>(c)?,
                )
            })?;
            if rows.first().is_none_or(|row| row.slot != -2) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        if rows.first().is_none_or(|row| row.slot < 0) {
            return Ok(None);
        }
        Ok(Some(
            rows.into_iter()
                .filter_map(|row| Some((row.queue?, usize::try_from(row.jobs).ok()?)))
                .collect(),
        ))
    }
}

/// A row of `tenure_reclaim_job_slot`.
#[cfg(feature = "postgres")]
#[derive(diesel::QueryableByName)]
struct ReclaimedRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    slot: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    queue: Option<String>,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    jobs: i64,
}

/// A slot a rotation or a reclaim returned (negative: none).
#[cfg(feature = "postgres")]
#[derive(diesel::QueryableByName)]
struct SlotRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    slot: i64,
}

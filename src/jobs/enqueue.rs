//! Enqueueing: one job (an upsert where it has a dedup key) or many in multi-row inserts.

use std::collections::HashSet;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};

use super::limits::{self, Limit};
use super::model::{IdRow, InsertedRow};
use super::{Enqueued, NewJob, ids_of};
use crate::backend::statement::{Statement, row, statement};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::sql_types::Instant;
use crate::transaction::write_turn;
use crate::{DibsConnection, Error, Result, transaction};

const INSERT_HEAD: &str = "INSERT INTO dibs_jobs \
    (queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at, dedup_key, \
     limit_key, limit_max) \
    VALUES";

/// One row; one shape for both kinds of due time: an instant, or NULL and a delay.
const INSERT_ROW: &str = "(?, ?, ?, ?, 'waiting', 0, ?, COALESCE(?, {now+ttl}), {now}, ?, ?, ?)";

/// PostgreSQL and SQLite: a job whose key a live job already has is not inserted; the live
/// job is returned instead, its `dedup_hits` counted up (so "existing" is `dedup_hits > 0`,
/// and the row comes from the upsert itself, which sees committed rows). Concurrent enqueues
/// of one key wait for each other on the unique index: exactly one inserts.
const INSERT_DEDUP_ON_CONFLICT: &str = " ON CONFLICT (queue, dedup_key) \
    WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'running') \
    DO UPDATE SET dedup_hits = dibs_jobs.dedup_hits + 1 RETURNING id, dedup_hits";

/// MySQL/MariaDB: the unique index is on the generated `live_dedup_key`. On a duplicate the
/// live job's `dedup_hits` changes, so the statement reports 2 affected rows (1 for an
/// insert, even with CLIENT_FOUND_ROWS), and `LAST_INSERT_ID(id)` makes its id the one
/// `LAST_INSERT_ID()` returns.
const INSERT_DEDUP_ON_DUPLICATE_KEY: &str =
    " ON DUPLICATE KEY UPDATE dedup_hits = dedup_hits + 1, id = LAST_INSERT_ID(id)";

/// The id of the row a MySQL/MariaDB insert made (or, with `LAST_INSERT_ID(id)` in an
/// upsert, found).
const LAST_INSERT_ID: &str = "SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS id";

/// Inserts one validated job on a concrete connection (or finds the live job with its dedup
/// key) and evaluates to `QueryResult<Enqueued>`. The id comes from RETURNING, or on MySQL
/// from `LAST_INSERT_ID()`, exact for a single-row statement on this connection (never
/// `LAST_INSERT_ID() + i` for a multi-row one: MySQL may interleave auto-increment values).
macro_rules! insert_one {
    ($c:ident, $job:expr) => {{
        let job: &NewJob = $job;
        let syntax = $c.syntax();
        let (at, delay) = job.due_params();
        let mut sql = syntax.render(&format!("{INSERT_HEAD} {INSERT_ROW}"));
        sql.push_str(match syntax.upsert {
            Upsert::OnConflictWhere => INSERT_DEDUP_ON_CONFLICT,
            Upsert::OnDuplicateKey => INSERT_DEDUP_ON_DUPLICATE_KEY,
        });
        if syntax.returning {
            sql.push_str(syntax.notify_in_returning);
        }
        let insert = statement(sql)
            .bind::<Text, _>(&job.queue)
            .bind::<Text, _>(&job.kind)
            .bind::<Binary, _>(&job.payload)
            .bind::<Integer, _>(job.priority)
            .bind::<Integer, _>(job.max_attempts as i32)
            .bind::<Nullable<Instant>, _>(at)
            .bind::<BigInt, _>(delay)
            .bind::<Nullable<Text>, _>(job.dedup_key.as_deref())
            .bind::<Nullable<Text>, _>(job.first_limit().0)
            .bind::<Nullable<Integer>, _>(job.first_limit().1);
        if syntax.returning {
            insert.get_result::<InsertedRow>($c).map(|row| Enqueued {
                id: row.id,
                existing: row.dedup_hits > 0 && job.dedup_key.is_some(),
            })
        } else {
            insert.execute($c).and_then(|affected| {
                statement(LAST_INSERT_ID)
                    .get_result::<IdRow>($c)
                    .map(|row| Enqueued {
                        id: row.id,
                        existing: affected == 2,
                    })
            })
        }
    }};
}

/// Enqueues one job on `conn`, inside the caller's transaction if there is one (so a
/// rolled-back transaction leaves no job). With a dedup key that a live job of the queue
/// already has, no job is made and that job's id comes back, marked
/// [`existing`](Enqueued::existing).
pub fn enqueue<C: DibsConnection>(conn: &mut C, job: &NewJob) -> Result<Enqueued> {
    job.validate()?;
    let enqueued = if job.limits.is_empty() {
        // SQLite: this process's writers take turns (see `dibs::transaction`); the insert is
        // one statement, so the turn is held only around it.
        let _turn = write_turn(conn)?;
        // Wakes idle workers too (PostgreSQL: a NOTIFY in the insert's RETURNING list).
        dispatch!(conn, c => insert_one!(c, job))?
    } else {
        // The job and its limits commit together: a job must never be claimable without
        // the limits that hold it back.
        transaction(conn, |conn| {
            let enqueued = dispatch!(conn, c => insert_one!(c, job))?;
            if !enqueued.existing {
                limits::record(conn, &[(enqueued.id, &job.limits)])?;
            }
            Ok::<Enqueued, Error>(enqueued)
        })?
    };
    crate::wake::wake([job.queue.as_str()]);
    #[cfg(feature = "metrics")]
    if !enqueued.existing {
        crate::metrics::record_enqueued(&job.queue, 1);
    }
    Ok(enqueued)
}

/// Wakes idle workers of these queues where the backend can (PostgreSQL NOTIFY, delivered
/// when the enqueueing transaction commits), after a multi-row insert.
fn notify<'q, C: DibsConnection>(
    conn: &mut C,
    queues: impl IntoIterator<Item = &'q str>,
) -> Result<()> {
    let queues: HashSet<&str> = queues.into_iter().collect();
    dispatch!(conn, c => {
        if let Some(sql) = c.syntax().notify_queue {
            for queue in queues {
                statement(c.syntax().render(sql)).bind::<Text, _>(queue).execute(c)?;
            }
        }
        Ok::<(), Error>(())
    })
}

/// Enqueues several jobs in one transaction (the caller's, if one is open: then in a
/// savepoint of it) and returns one [`Enqueued`] per job, in the order given. Nothing is
/// written if any job is invalid. Jobs with a dedup key are deduplicated against live jobs
/// and against earlier jobs of the same batch.
///
/// Jobs without a dedup key go in multi-row statements of up to [`INSERT_CHUNK_ROWS`] rows
/// (and about [`INSERT_CHUNK_BYTES`] of payload). PostgreSQL and SQLite return their ids
/// (`RETURNING id`: within one statement rows are inserted in order and ids only grow, so the
/// ascending ids are the jobs in order). MySQL/MariaDB has no RETURNING: there the ids are
/// `LAST_INSERT_ID()` onwards, which holds only where InnoDB reserves one run of ids per
/// statement (`innodb_autoinc_lock_mode` 0 or 1, MariaDB's default); under mode 2 (MySQL 8's
/// default) every job is its own statement. Jobs with a key are inserted one statement each,
/// all in the one transaction.
pub fn enqueue_many<C: DibsConnection>(conn: &mut C, jobs: &[NewJob]) -> Result<Vec<Enqueued>> {
    if jobs.is_empty() {
        return Err(Error::invalid("jobs", "an empty batch"));
    }
    for job in jobs {
        job.validate()?;
    }
    let enqueued = transaction(conn, |conn| {
        dispatch!(conn, c => {
            let syntax = c.syntax();
            // Without RETURNING (MySQL), a multi-row insert's ids are known only where the
            // server hands out consecutive ones per statement.
            let id_step = if syntax.returning { None } else { consecutive_id_step(c)? };
            let multi_row = syntax.returning || id_step.is_some();
            let mut out = Vec::with_capacity(jobs.len());
            let mut rest = jobs;
            while !rest.is_empty() {
                // The run of jobs without a key at the head of `rest` goes in multi-row
                // statements; a keyed job goes alone.
                let run = if multi_row {
                    rest.iter().take_while(|job| job.dedup_key.is_none()).count()
                } else {
                    0
                };
                if run == 0 {
                    if let Some((job, tail)) = rest.split_first() {
                        let enqueued = insert_one!(c, job)?;
                        if !enqueued.existing && !job.limits.is_empty() {
                            limits::record(c, &[(enqueued.id, &job.limits)])?;
                        }
                        out.push(enqueued);
                        rest = tail;
                    }
                    continue;
                }
                for chunk in chunks(&rest[..run]) {
                    let rows = vec![INSERT_ROW; chunk.len()].join(", ");
                    let returning = if syntax.returning { " RETURNING id" } else { "" };
                    let sql = syntax.render(&format!("{INSERT_HEAD} {rows}{returning}"));
                    let rows = chunk
                        .iter()
                        .map(|job| {
                            let (at, delay) = job.due_params();
                            row()
                                .bind::<Text, _>(job.queue.as_str())
                                .bind::<Text, _>(job.kind.as_str())
                                .bind::<Binary, _>(job.payload.as_slice())
                                .bind::<Integer, _>(job.priority)
                                .bind::<Integer, _>(job.max_attempts as i32)
                                .bind::<Nullable<Instant>, _>(at)
                                .bind::<BigInt, _>(delay)
                                .bind::<Nullable<Text>, _>(None::<&str>)
                                .bind::<Nullable<Text>, _>(job.first_limit().0)
                                .bind::<Nullable<Integer>, _>(job.first_limit().1)
                        })
                        .collect();
                    // The text changes with the row count: not kept prepared.
                    let insert = statement(sql).uncached().bind_rows(rows);
                    let mut ids: Vec<i64> = match id_step {
                        None => insert.load::<IdRow>(c).map(ids_of)?,
                        Some(step) => {
                            let inserted = insert.execute(c)?;
                            let first = statement(LAST_INSERT_ID)
                                .get_result::<IdRow>(c)?
                                .id;
                            if inserted != chunk.len() {
                                return Err(unexpected(format!("{inserted} rows inserted for {} jobs", chunk.len())));
                            }
                            (0..chunk.len() as i64).map(|i| first + i * step).collect()
                        }
                    };
                    if ids.len() != chunk.len() {
                        return Err(unexpected(format!("{} ids for {} inserted jobs", ids.len(), chunk.len())));
                    }
                    ids.sort_unstable();
                    let limited: Vec<(i64, &[Limit])> = ids
                        .iter()
                        .zip(chunk.iter())
                        .filter(|(_, job)| !job.limits.is_empty())
                        .map(|(id, job)| (*id, job.limits.as_slice()))
                        .collect();
                    if !limited.is_empty() {
                        limits::record(c, &limited)?;
                    }
                    out.extend(ids.into_iter().map(|id| Enqueued { id, existing: false }));
                }
                rest = &rest[run..];
            }
            Ok::<Vec<Enqueued>, Error>(out)
        })
    })?;
    let fresh: HashSet<&str> = jobs
        .iter()
        .zip(&enqueued)
        .filter(|(_, e)| !e.existing)
        .map(|(job, _)| job.queue.as_str())
        .collect();
    notify(conn, fresh.iter().copied())?;
    #[cfg(feature = "metrics")]
    for queue in &fresh {
        let n = jobs
            .iter()
            .zip(&enqueued)
            .filter(|(job, e)| !e.existing && job.queue == *queue)
            .count();
        crate::metrics::record_enqueued(queue, n);
    }
    crate::wake::wake(fresh);
    Ok(enqueued)
}

fn unexpected(message: String) -> Error {
    Error::Database(diesel::result::Error::DeserializationError(message.into()))
}

#[derive(QueryableByName)]
struct AutoIncrement {
    #[diesel(sql_type = BigInt)]
    lock_mode: i64,
    #[diesel(sql_type = BigInt)]
    step: i64,
}

/// MySQL/MariaDB: the step between the ids of one multi-row insert, where they are
/// consecutive: InnoDB's `innodb_autoinc_lock_mode` 0 ("traditional") and 1 ("consecutive",
/// MariaDB's default) reserve one run of ids per simple insert statement, so the rows get
/// `LAST_INSERT_ID()`, then `+ auto_increment_increment` each. Mode 2 ("interleaved",
/// MySQL 8's default) does not promise that: `None`, one statement per row.
fn consecutive_id_step<C: diesel::Connection>(c: &mut C) -> Result<Option<i64>>
where
    Statement: diesel::query_dsl::LoadQuery<'static, C, AutoIncrement>,
{
    let row = statement(
        "SELECT CAST(@@innodb_autoinc_lock_mode AS SIGNED) AS lock_mode, \
                CAST(@@auto_increment_increment AS SIGNED) AS step",
    )
    .get_result::<AutoIncrement>(c)?;
    Ok((row.lock_mode <= 1 && row.step >= 1).then_some(row.step))
}

/// Rows per multi-row insert: 7 parameters a row stays well under SQLite's 32,766 and
/// PostgreSQL's 65,535 parameters per statement.
pub const INSERT_CHUNK_ROWS: usize = 1000;
/// Payload bytes per multi-row insert, past which a new statement starts.
pub const INSERT_CHUNK_BYTES: usize = 4 * 1024 * 1024;

/// Splits a batch into statements of at most [`INSERT_CHUNK_ROWS`] rows and about
/// [`INSERT_CHUNK_BYTES`] of payload (one larger job goes alone).
fn chunks(jobs: &[NewJob]) -> Vec<&[NewJob]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, job) in jobs.iter().enumerate() {
        let full = i - start >= INSERT_CHUNK_ROWS || bytes + job.payload.len() > INSERT_CHUNK_BYTES;
        if full && i > start {
            out.push(&jobs[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += job.payload.len();
    }
    out.push(&jobs[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_cut_by_rows_and_bytes() {
        let small = |n: usize| vec![NewJob::new("q", "k", vec![0u8; 10]); n];
        let sizes = |jobs: &[NewJob]| chunks(jobs).iter().map(|c| c.len()).collect::<Vec<_>>();
        assert_eq!(sizes(&small(1)), vec![1]);
        assert_eq!(sizes(&small(INSERT_CHUNK_ROWS)), vec![INSERT_CHUNK_ROWS]);
        assert_eq!(
            sizes(&small(INSERT_CHUNK_ROWS + 1)),
            vec![INSERT_CHUNK_ROWS, 1]
        );
        let big = NewJob::new("q", "k", vec![0u8; INSERT_CHUNK_BYTES / 2 + 1]);
        assert_eq!(sizes(&[big.clone(), big.clone(), big]), vec![1, 1, 1]);
        let huge = NewJob::new("q", "k", vec![0u8; INSERT_CHUNK_BYTES + 1]);
        assert_eq!(sizes(&[huge.clone(), huge]), vec![1, 1]);
    }
}

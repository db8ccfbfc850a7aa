//! Enqueueing many jobs at once: plain jobs in multi-row inserts (on PostgreSQL, long runs
//! by COPY: `copy_in`), keyed jobs in multi-row upserts where the backend returns
//! rows, the rest one statement each, all in one transaction.

use std::collections::{HashMap, HashSet};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};

use super::enqueue::{
    FIND_FINISHED_TWIN, FOLD_FINISHED, INSERT_DEDUP_ON_CONFLICT, INSERT_DEDUP_ON_DUPLICATE_KEY,
    INSERT_HEAD, INSERT_HEAD_WRITING_ENTRIES, INSERT_ROW, INSERT_ROW_WRITING_ENTRIES,
    INSERTED_RETURNING, KEYED_INSERT_HEAD, fold_into_finished_twin, insert_deduplicated,
    insert_dependent, insert_in_sequence, insert_one, job_row, lock_dependencies, on_conflict_sets,
    on_duplicate_key_sets, unexpected,
};
use super::model::InsertedRow;
use super::{DedupOver, Enqueued, NewJob, OnDuplicate, ids_of};
use crate::backend::statement::{row, statement};
use crate::backend::transaction::{in_transaction, retrying_transaction};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::jobs::flow::limits::{self, Limit};
use crate::jobs::flow::{fairness, sequences};
use crate::rows::IdRow;
use crate::sql_types::Instant;
use crate::wake;
use crate::{Error, Result, TenureConnection};

/// The length of the run of keyed jobs at the head of `jobs` that can share one multi-row
/// upsert: each with a dedup key and no window (whose twin checks are per job) or
/// dependencies, all with the first one's [`OnDuplicate`] mode (the statement's text), and
/// no queue and key twice (an upsert cannot change one row twice; a later twin waits for the
/// next statement, which folds it into the first).
fn keyed_run(jobs: &[NewJob]) -> usize {
    let Some(mode) = jobs.first().map(|job| job.on_duplicate) else {
        return 0;
    };
    let mut seen = HashSet::new();
    jobs.iter()
        .take_while(|job| {
            job.dedup_window.is_none()
                && job.dependencies.is_empty()
                && job.on_duplicate == mode
                && job
                    .dedup_key
                    .as_deref()
                    .is_some_and(|key| seen.insert((job.queue.as_str(), key)))
        })
        .count()
}

/// A keyed job's row from a multi-row upsert: matched to its job by queue and key (the order
/// of RETURNING rows is not promised).
#[derive(QueryableByName)]
struct UpsertedRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    dedup_hits: i64,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    dedup_key: String,
}

/// Upserts a [`keyed_run`] chunk in one statement (ON CONFLICT, or ON DUPLICATE KEY on
/// MariaDB, with RETURNING) and evaluates to `Result<Vec<Enqueued>>`, in the chunk's order,
/// with the same outcome per job as [`insert_one!`]. MariaDB: the rows it inserts get their
/// ready entries from one statement after it ([`write_ready_entries!`]).
macro_rules! upsert_keyed_rows {
    ($c:ident, $chunk:expr) => {{
        let chunk: &[NewJob] = $chunk;
        let syntax = $c.syntax();
        let mode = chunk[0].on_duplicate;
        // Made anew: the text changes with the row count.
        let (tail, sets) = match syntax.upsert {
            Upsert::OnConflictWhere => (INSERT_DEDUP_ON_CONFLICT, on_conflict_sets(mode)),
            Upsert::OnDuplicateKey => (INSERT_DEDUP_ON_DUPLICATE_KEY, on_duplicate_key_sets(mode)),
        };
        let (head, row_values) = insert_shape(syntax, true);
        let rows = vec![row_values; chunk.len()].join(", ");
        let sql = syntax.fill_with(
            &format!("{head} {rows}{tail}, queue, dedup_key"),
            &[("sets", sets)],
        );
        let rows = chunk.iter().map(|job| job_row!(row(), job)).collect();
        // The text changes with the row count: not kept prepared (see INSERT_CHUNK_ROWS).
        statement(sql)
            .uncached()
            .bind_rows(rows)
            .load::<UpsertedRow>($c)
            .map_err(Error::from)
            .and_then(|rows| {
                let mut by_key: HashMap<(String, String), UpsertedRow> = rows
                    .into_iter()
                    .map(|row| ((row.queue.clone(), row.dedup_key.clone()), row))
                    .collect();
                let moded = mode != OnDuplicate::Keep;
                chunk
                    .iter()
                    .map(|job| {
                        let key = (job.queue.clone(), job.dedup_key.clone().unwrap_or_default());
                        let row = by_key.remove(&key).ok_or_else(|| {
                            unexpected(format!("no row came back for key {:?}", key.1))
                        })?;
                        let existing = row.dedup_hits > 0;
                        Ok(Enqueued {
                            id: row.id,
                            existing,
                            updated: existing
                                && moded
                                && row.state == "waiting"
                                && row.kind == job.kind,
                        })
                    })
                    .collect::<Result<Vec<Enqueued>>>()
            })
            .and_then(|enqueued| {
                let new: Vec<i64> = enqueued
                    .iter()
                    .filter(|e| !e.existing)
                    .map(|e| e.id)
                    .collect();
                write_ready_entries!($c, &new)?;
                Ok(enqueued)
            })
    }};
}

/// The head and row of a multi-row insert: on MariaDB marked, for [`write_ready_entries!`];
/// `keyed` rows (each with a dedup key) on PostgreSQL into the partition that holds the key's
/// unique index (`{keyed_jobs}`; MariaDB keeps one table, so its marked head names it).
fn insert_shape(syntax: &crate::backend::Syntax, keyed: bool) -> (&'static str, &'static str) {
    match (syntax.ready_entries, keyed) {
        (Some(_), _) => (INSERT_HEAD_WRITING_ENTRIES, INSERT_ROW_WRITING_ENTRIES),
        (None, true) => (KEYED_INSERT_HEAD, INSERT_ROW),
        (None, false) => (INSERT_HEAD, INSERT_ROW),
    }
}

/// MariaDB: writes the ready entries of waiting jobs a marked multi-row insert made (`ids`,
/// every one waiting: no job of a multi-row insert has dependencies), one statement, and
/// evaluates to `Result<()>`; elsewhere nothing (PostgreSQL's ring trigger runs once a
/// statement; SQLite has no ring). Exactly one entry a job, or the enqueue fails (and rolls
/// back).
macro_rules! write_ready_entries {
    ($c:ident, $ids:expr) => {{
        let ids: &[i64] = $ids;
        match $c.syntax().ready_entries {
            Some(entries) if !ids.is_empty() => {
                let written = statement(entries)
                    .bind_ids(ids.iter().copied())
                    .execute($c)?;
                if written == ids.len() {
                    Ok(())
                } else {
                    Err(unexpected(format!(
                        "{written} ready entries for {} inserted jobs",
                        ids.len()
                    )))
                }
            }
            _ => Ok::<(), Error>(()),
        }
    }};
}

/// Enqueues several jobs in one transaction (the caller's, if one is open: then in a
/// savepoint of it) and returns one [`Enqueued`] per job, in the order given. Nothing is
/// written if any job is invalid. Jobs with a dedup key are deduplicated against live jobs
/// and against earlier jobs of the same call, with their [`NewJob::on_duplicate`] mode and
/// [`NewJob::dedup_window`], as [`enqueue`](crate::jobs::enqueue) does.
///
/// Jobs without a dedup key go in multi-row statements of up to `INSERT_CHUNK_ROWS` (1000) rows
/// (and about `INSERT_CHUNK_BYTES` (4 MiB) of payload), which return their ids (`RETURNING
/// id`: within one statement rows are inserted in order and ids only grow, so the ascending
/// ids are the jobs in order, whatever MariaDB's `innodb_autoinc_lock_mode`). Runs of jobs
/// with a key and no window nor dependencies go in multi-row upserts; the rest one statement
/// each, all in the one transaction.
pub fn enqueue_many<C: TenureConnection>(conn: &mut C, jobs: &[NewJob]) -> Result<Vec<Enqueued>> {
    if jobs.is_empty() {
        return Err(Error::invalid("jobs", "an empty batch"));
    }
    for job in jobs {
        job.validate()?;
    }
    let inline = in_transaction(conn);
    let enqueued = retrying_transaction(conn, |conn| {
        // Fair jobs take their tenants' next stamps first (their rows locked in key order,
        // before any other lock).
        let stamped = fairness::stamped(conn, jobs)?;
        let jobs = &stamped[..];
        // Jobs of sequences go one by one, in the batch's order (each locks its key's row and
        // waits for the one before it, which may be earlier in this batch).
        if jobs.iter().any(|job| job.sequence.is_some()) {
            let enqueued = enqueue_one_by_one(conn, jobs)?;
            if inline {
                wake::notify(conn, fresh_queues(jobs, &enqueued))?;
            }
            return Ok(enqueued);
        }
        #[cfg(feature = "postgres")]
        if super::copy_in::wanted(jobs)
            && let crate::BackendConnection::Postgres(pg) = conn.backend_connection()
            && let Some(ids) = super::copy_in::copy_jobs(pg, jobs)?
        {
            let limited: Vec<(i64, &[Limit])> = ids
                .iter()
                .zip(jobs)
                .filter(|(_, job)| !job.limits.is_empty())
                .map(|(id, job)| (*id, job.limits.as_slice()))
                .collect();
            if !limited.is_empty() {
                limits::record(conn, &limited)?;
            }
            let enqueued: Vec<Enqueued> = ids
                .into_iter()
                .map(|id| Enqueued {
                    id,
                    existing: false,
                    updated: false,
                })
                .collect();
            if inline {
                wake::notify(conn, fresh_queues(jobs, &enqueued))?;
            }
            return Ok(enqueued);
        }
        let locked = lock_dependencies(conn, jobs)?;
        let enqueued = dispatch!(conn, c => {
            let syntax = c.syntax();
            let mut out = Vec::with_capacity(jobs.len());
            let mut rest = jobs;
            while !rest.is_empty() {
                // The run of jobs without a key at the head of `rest` goes in multi-row
                // statements, and so does a run of keyed jobs (upserts).
                let run = rest
                    .iter()
                    .take_while(|job| job.dedup_key.is_none() && job.dependencies.is_empty())
                    .count();
                let keyed = keyed_run(rest);
                if run == 0 && keyed >= 2 {
                    for chunk in chunks(&rest[..keyed]) {
                        let enqueued = upsert_keyed_rows!(c, chunk)?;
                        let limited: Vec<(i64, &[Limit])> = enqueued
                            .iter()
                            .zip(chunk.iter())
                            .filter(|(e, job)| !e.existing && !job.limits.is_empty())
                            .map(|(e, job)| (e.id, job.limits.as_slice()))
                            .collect();
                        if !limited.is_empty() {
                            limits::record(c, &limited)?;
                        }
                        out.extend(enqueued);
                    }
                    rest = &rest[keyed..];
                    continue;
                }
                if run == 0 {
                    if let Some((job, tail)) = rest.split_first() {
                        if !job.dependencies.is_empty() {
                            out.push(insert_dependent(c, job, &locked)?);
                            rest = tail;
                            continue;
                        }
                        let enqueued = insert_deduplicated!(c, job, false)?;
                        if !enqueued.existing && !job.limits.is_empty() {
                            limits::record(c, &[(enqueued.id, &job.limits)])?;
                        }
                        out.push(enqueued);
                        rest = tail;
                    }
                    continue;
                }
                for chunk in chunks(&rest[..run]) {
                    let (head, row_values) = insert_shape(syntax, false);
                    let rows = vec![row_values; chunk.len()].join(", ");
                    let sql = syntax.fill(&format!("{head} {rows} RETURNING id"));
                    let rows = chunk
                        .iter()
                        .map(|job| job_row!(row(), job))
                        .collect();
                    // The text changes with the row count: not kept prepared (see
                    // INSERT_CHUNK_ROWS).
                    let mut ids: Vec<i64> = statement(sql)
                        .uncached()
                        .bind_rows(rows)
                        .load::<IdRow>(c)
                        .map(ids_of)?;
                    if ids.len() != chunk.len() {
                        return Err(unexpected(format!("{} ids for {} inserted jobs", ids.len(), chunk.len())));
                    }
                    // Within one statement rows are inserted in order and ids only grow.
                    ids.sort_unstable();
                    write_ready_entries!(c, &ids)?;
                    let limited: Vec<(i64, &[Limit])> = ids
                        .iter()
                        .zip(chunk.iter())
                        .filter(|(_, job)| !job.limits.is_empty())
                        .map(|(id, job)| (*id, job.limits.as_slice()))
                        .collect();
                    if !limited.is_empty() {
                        limits::record(c, &limited)?;
                    }
                    out.extend(ids.into_iter().map(|id| Enqueued { id, existing: false, updated: false }));
                }
                rest = &rest[run..];
            }
            Ok::<Vec<Enqueued>, Error>(out)
        })?;
        // In a caller's transaction, NOTIFY goes with it (delivered if it commits); a
        // failure here is the enqueue's.
        if inline {
            wake::notify(conn, fresh_queues(jobs, &enqueued))?;
        }
        Ok(enqueued)
    })?;
    let fresh = fresh_queues(jobs, &enqueued);
    if !inline {
        wake::notify_committed(conn, fresh.iter().copied());
    }
    #[cfg(feature = "metrics")]
    for queue in &fresh {
        let n = jobs
            .iter()
            .zip(&enqueued)
            .filter(|(job, e)| !e.existing && job.queue == *queue)
            .count();
        if n > 0 {
            super::enqueue::count_enqueued(queue, n);
        }
    }
    wake::wake(fresh);
    Ok(enqueued)
}

/// The queues of the jobs an enqueue made or changed (a mode may have moved a waiting job's
/// due time earlier); not those folded into existing ones unchanged.
fn fresh_queues<'j>(jobs: &'j [NewJob], enqueued: &[Enqueued]) -> HashSet<&'j str> {
    jobs.iter()
        .zip(enqueued)
        .filter(|(_, e)| !e.existing || e.updated)
        .map(|(job, _)| job.queue.as_str())
        .collect()
}

/// Rows per multi-row insert: 11 parameters a row stays well under SQLite's 32,766 and
/// PostgreSQL's 65,535 parameters per statement. Its statement is prepared for each chunk
/// and closed: preparing is a third of a chunk's time on MariaDB (16 ms of 65), but a
/// statement kept prepared holds server memory by its placeholders, about 10 MB on MariaDB
/// and 3.3 MB on PostgreSQL for 1,000 rows, for the connection's life (measured, and kept
/// prepared it made MariaDB's bulk 1.3x); chunks of 100 rows kept prepared lost more to
/// their round trips than they saved (BENCHMARKS.md).
pub(crate) const INSERT_CHUNK_ROWS: usize = 1000;
/// Payload bytes per multi-row insert, past which a new statement starts.
pub(crate) const INSERT_CHUNK_BYTES: usize = 4 * 1024 * 1024;

/// A batch with jobs of sequences, one job at a time in the batch's order, in the caller's
/// transaction: a sequence's job may wait for one earlier in the batch.
fn enqueue_one_by_one<C: TenureConnection>(conn: &mut C, jobs: &[NewJob]) -> Result<Vec<Enqueued>> {
    // Every key's row first, in one order (sorted) for every batch: two batches of the same
    // keys in different orders deadlocked on every try.
    let keys: std::collections::BTreeSet<&str> =
        jobs.iter().filter_map(|job| job.sequence_key()).collect();
    for key in keys {
        sequences::lock_last(conn, key)?;
    }
    let mut out = Vec::with_capacity(jobs.len());
    for job in jobs {
        let enqueued = if job.sequence.is_some() {
            insert_in_sequence(conn, job)?
        } else if !job.dependencies.is_empty() {
            let locked = lock_dependencies(conn, std::slice::from_ref(job))?;
            insert_dependent(conn, job, &locked)?
        } else {
            let enqueued = dispatch!(conn, c => insert_deduplicated!(c, job, false))?;
            if !enqueued.existing && !job.limits.is_empty() {
                limits::record(conn, &[(enqueued.id, &job.limits)])?;
            }
            enqueued
        };
        out.push(enqueued);
    }
    Ok(out)
}

/// Splits a bulk enqueue into statements of at most `INSERT_CHUNK_ROWS` (1000) rows and about
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
    fn bulk_enqueues_are_cut_by_rows_and_bytes() {
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

//! The job queue: enqueue, claim, and finish jobs (`dibs_jobs`).
//!
//! A job is *waiting* (due now or later, retries included), *running* (claimed by a worker
//! for a limited time, under a fresh random claim token), *completed* or *dead* (failed for
//! good). Delayed jobs are plain waiting rows with a future due time: there is no promotion
//! pass.
//!
//! | operation | connection | notes |
//! |---|---|---|
//! | [`enqueue`], [`enqueue_many`] | any, joins the caller's transaction | a rolled-back transaction leaves no job |
//! | [`claim`] | bare | atomic: no job is ever held by two claimers |
//! | [`complete`], [`fail`], [`renew`], [`give_back`] | any; inside the caller's transaction they commit with it | fenced by the claim token, one [`Outcome`] per job |
//! | [`rescue`] | bare | returns stalled jobs (claim lapsed) to the queue, or marks them dead |
//! | [`get`] | any | a job's state |
//!
//! Handlers run at least once. The only exactly-once there is: the handler's own writes and
//! [`complete`] in one transaction ([`crate::transaction`]), which commits only if the claim
//! is still this worker's.
//!
//! ```
//! # fn main() -> Result<(), dibs::Error> {
//! use std::time::Duration;
//! use dibs::jobs::{self, NewJob, Outcome};
//! let mut conn = dibs::AnyConnection::connect(":memory:")?;
//! dibs::run_migrations(&mut conn)?;
//!
//! let id = jobs::enqueue(&mut conn, &NewJob::new("mail", "welcome", b"ada@example.com".to_vec()))?.id;
//! let claimed = jobs::claim(&mut conn, "mail", 10, Duration::from_secs(60))?;
//! assert_eq!(claimed[0].id, id);
//! assert_eq!(jobs::complete(&mut conn, &[claimed[0].claim()])?, vec![Outcome::Done]);
//! # Ok(()) }
//! ```

mod manage;
mod model;
mod retention;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};

use crate::backend::statement::{Statement, row, statement};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::sql_types::Instant;
use crate::transaction::{bare_write_transaction, write_turn};
use crate::{DibsConnection, Error, Result, transaction, validate};

pub use manage::{
    FailedRun, JobFilter, MAX_OUTPUT_BYTES, QueueStats, RunOutput, RunningJob, Stats, cancel,
    history, is_paused, list, outputs, pause, record_output, resume, retry_dead,
    retry_dead_of_kind, stats,
};
pub use model::{
    Backoff, ClaimedJob, Due, Enqueued, Job, JobClaim, JobState, NewJob, Outcome, Rescued, Retry,
};
use model::{Candidate, IdRow, IdStateRow, InsertedRow, JobRow, LockedClaim, StateRow};
pub use retention::{Finished, Retention, prune};

/// What a claim reads back of the jobs it claimed ([`model::JobRow`]).
const CLAIMED_COLUMNS: &str = "id, queue, kind, payload, priority, attempt, max_attempts, \
    due_at, claim_token, claim_expires_at";

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

/// Claim, step 1 of 3: lock the jobs to claim, in order, skipping rows other claimers hold
/// (SQLite: the IMMEDIATE transaction serializes claimers). Nothing from a paused queue.
/// Subqueries are plain reads: a locking clause does not lock what they read. Jobs whose
/// limit key is already
/// saturated are left out, so they do not crowd out the others; this read of the running
/// counts is only a filter (step 2 decides under the key's lock). The index on
/// `(queue, [state,] priority, due_at, id)` serves filter and order, so InnoDB reads (and
/// locks) only the rows it returns. MySQL rejects LIMIT in an `IN (subquery)`, hence
/// separate statements.
const CLAIM_PICK: &str = "\
    SELECT id, limit_key, limit_max FROM dibs_jobs{claim_index} \
    WHERE queue = ? AND state = 'waiting' AND due_at <= {now} \
      AND NOT EXISTS (SELECT 1 FROM dibs_queue_pauses p WHERE p.queue = ?) \
      AND (limit_key IS NULL OR limit_key NOT IN ( \
          SELECT r.limit_key FROM dibs_jobs r \
          WHERE r.state = 'running' AND r.limit_key IS NOT NULL \
          GROUP BY r.limit_key HAVING COUNT(*) >= MIN(r.limit_max))) \
    ORDER BY priority, due_at, id LIMIT ?{skip_locked}";

/// Claim, step 2, per limit key among the candidates (in key order, so claimers never wait
/// on each other in a cycle): take the key's lock (an upsert locks its row until commit),
/// then count its running jobs. Every claim of a key holds that lock while it decides, so
/// the count cannot be overtaken; finishing jobs only lower it.
const LIMIT_LOCK_ON_CONFLICT: &str = "\
    INSERT INTO dibs_limit_keys (limit_key) VALUES (?) \
    ON CONFLICT (limit_key) DO UPDATE SET limit_key = excluded.limit_key";
const LIMIT_LOCK_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO dibs_limit_keys (limit_key) VALUES (?) \
    ON DUPLICATE KEY UPDATE limit_key = VALUES(limit_key)";
const LIMIT_RUNNING: &str =
    "SELECT COUNT(*) AS n FROM dibs_jobs WHERE limit_key = ? AND state = 'running'";

/// Claim, step 3: claim exactly the accepted ids (a bound list, see `backend::statement`),
/// each with its own random token. The WHERE is the primary key alone, so no other index can
/// serve it (a `state = ...` condition could be served by the stalled-claims index on MySQL,
/// locking other rows). RETURNING where there is one; MySQL reads them back.
const CLAIM_MARK: &str = "\
    UPDATE dibs_jobs SET state = 'running', attempt = attempt + 1, \
        claim_token = {random_token}, claimed_at = {now}, claim_expires_at = {now+ttl} \
    WHERE id IN {ids}";

/// Rescue, step 3: return lapsed claims to the queue without using an attempt (the worker
/// may have died before the run began: jobs claimed ahead never start), counting the lapse;
/// a job asked to cancel is cancelled; a job whose claims lapsed [`MAX_LAPSES`] times (it
/// takes its worker down every time) is dead. Only rows this transaction holds locked and
/// found stalled (step 2), so a job completed or renewed meanwhile is left alone. The WHERE
/// is the primary key alone: with a condition on `state`, MariaDB may serve the UPDATE from
/// an index on `state` and lock rows other transactions hold (that deadlocked with
/// heartbeats in the race test). MySQL assigns left to right, reading the values assigned
/// before: `state` and `lapses` come last, so every CASE reads the row as it was.
const RESCUE_SET: &str = "\
    UPDATE dibs_jobs SET \
        finished_at = CASE WHEN cancel_requested_at IS NOT NULL OR lapses + 1 >= ? \
            THEN {now} ELSE NULL END, \
        last_error = 'the claim lapsed: the worker stalled or died', \
        attempt = attempt - 1, \
        claim_token = NULL, claim_expires_at = NULL, due_at = {now}, \
        state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' \
            WHEN lapses + 1 >= ? THEN 'dead' ELSE 'waiting' END, \
        lapses = lapses + 1 \
    WHERE id IN {ids}";

/// The error a rescued run leaves in the job's history (as in `RESCUE_SET`).
const RESCUE_ERROR: &str = "the claim lapsed: the worker stalled or died";

/// Rescue, step 1: candidates, by a plain read of the stalled-claims index. Not a locking
/// read: on MariaDB 10.11 a `FOR UPDATE SKIP LOCKED` scan of this secondary index waits for
/// (instead of skipping) entries a concurrent heartbeat is rewriting, while the heartbeat
/// waits for entries the scan locked: a deadlock (seen in the heartbeat/rescue race test).
const RESCUE_CANDIDATES: &str = "\
    SELECT id FROM dibs_jobs WHERE state = 'running' AND claim_expires_at <= {now} \
    ORDER BY claim_expires_at LIMIT ?";

/// Rescue, step 2: lock the candidates by primary key (`WHERE id IN` only, so no index but
/// the primary key can serve it), skipping rows a heartbeat or a finisher holds, and read
/// them as locked: still stalled is decided on these rows.
const RESCUE_LOCK: &str = "SELECT id, state, claim_expires_at, {now} AS db_now FROM dibs_jobs WHERE id IN {ids}{skip_locked}";

/// Finishing calls lock the rows they are about, then decide per job.
const LOCK_STATES: &str = "\
    SELECT id, state, claim_token, attempt, max_attempts, cancel_requested_at \
    FROM dibs_jobs WHERE id IN {ids}{for_update}";

/// A run of a job asked to cancel ends: the job is cancelled (not completed, failed or given
/// back), and its limit key is free.
const FINISH_CANCELLED: &str = "\
    UPDATE dibs_jobs SET state = 'cancelled', finished_at = {now}, claim_expires_at = NULL \
    WHERE id IN {ids}";

const COMPLETE: &str = "\
    UPDATE dibs_jobs SET state = 'completed', finished_at = {now}, claim_expires_at = NULL \
    WHERE id IN {ids}";

const RENEW: &str = "UPDATE dibs_jobs SET claim_expires_at = {now+ttl} WHERE id IN {ids}";

/// Give back: due again at once, and the run does not count.
const GIVE_BACK: &str = "\
    UPDATE dibs_jobs SET state = 'waiting', attempt = attempt - 1, due_at = {now}, \
        claim_expires_at = NULL \
    WHERE id IN {ids}";

const FAIL_RETRY: &str = "\
    UPDATE dibs_jobs SET state = 'waiting', due_at = COALESCE(?, {now+ttl}), last_error = ?, \
        claim_expires_at = NULL \
    WHERE id = ?";

const FAIL_DEAD: &str = "\
    UPDATE dibs_jobs SET state = 'dead', finished_at = {now}, last_error = ?, \
        claim_expires_at = NULL \
    WHERE id = ?";

const RECORD_ERROR: &str = "\
    INSERT INTO dibs_job_errors (job_id, attempt, error, failed_at) \
    SELECT id, COALESCE(?, attempt), ?, {now} FROM dibs_jobs WHERE id = ?";

/// The id of the newest error past the ones a job's history keeps: it and older ones go. A
/// plain read, then a delete by range (in one statement, MySQL's subquery of the delete
/// takes shared locks on the index, and two trims deadlocked in the rescue race test).
const ERROR_CUTOFF: &str = "\
    SELECT id FROM dibs_job_errors WHERE job_id = ? ORDER BY id DESC LIMIT 1 OFFSET 20";
const TRIM_ERRORS: &str = "DELETE FROM dibs_job_errors WHERE job_id = ? AND id <= ?";

/// The id of the row a MySQL/MariaDB insert made (or, with `LAST_INSERT_ID(id)` in an
/// upsert, found).
const LAST_INSERT_ID: &str = "SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS id";

/// How many errors a job's history keeps (the newest).
pub const MAX_ERROR_HISTORY: usize = 20;

/// The largest payload, in bytes (MariaDB's default `max_allowed_packet` is 16 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 8 * 1024 * 1024;
/// A job whose claim lapsed this many times (its worker died or stalled holding it each
/// time) is dead: a job that takes its worker down cannot loop forever. A lapsed claim uses
/// no attempt, since the worker may have died before the run began.
pub const MAX_LAPSES: u32 = 5;
/// The most attempts a job may have.
pub const MAX_ATTEMPTS: u32 = 1000;
/// The most jobs one claim or one batch call handles.
pub const MAX_BATCH: usize = 1000;
/// Longer error messages are cut to this many bytes (at a character boundary).
pub const MAX_ERROR_BYTES: usize = 4096;

fn ids_of(rows: Vec<IdRow>) -> Vec<i64> {
    rows.into_iter().map(|row| row.id).collect()
}

/// How many jobs one call may claim or rescue: 1 to [`MAX_BATCH`].
fn check_limit(limit: usize) -> Result<i64> {
    if limit == 0 || limit > MAX_BATCH {
        return Err(Error::invalid(
            "limit",
            format!("{limit} is not between 1 and {MAX_BATCH}"),
        ));
    }
    Ok(limit as i64)
}

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
            .bind::<Nullable<Text>, _>(job.limit.as_ref().map(|(key, _)| key.as_str()))
            .bind::<Nullable<Integer>, _>(job.limit.as_ref().map(|(_, max)| *max as i32));
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
    // SQLite: this process's writers take turns (see `dibs::transaction`); the insert is one
    // statement, so the turn is held only around it.
    let turn = write_turn(conn)?;
    // Wakes idle workers too (PostgreSQL: a NOTIFY in the insert's RETURNING list).
    let enqueued = dispatch!(conn, c => insert_one!(c, job))?;
    drop(turn);
    crate::wake::wake([job.queue.as_str()]);
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
                        out.push(insert_one!(c, job)?);
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
                                .bind::<Nullable<Text>, _>(job.limit.as_ref().map(|(key, _)| key.as_str()))
                                .bind::<Nullable<Integer>, _>(job.limit.as_ref().map(|(_, max)| *max as i32))
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

/// Claims up to `limit` due jobs of `queue` for `ttl`, by priority, then due time, then id.
/// Atomic: no job is ever held by two claimers. Each job comes with its attempt number
/// (counting this run) and a fresh claim token. Needs a bare connection.
///
/// In one transaction (READ COMMITTED on PostgreSQL and MySQL/MariaDB, IMMEDIATE on SQLite):
/// `SELECT ... FOR UPDATE SKIP LOCKED` of the ids in order (no locking clause on SQLite),
/// the concurrency limits of any limit keys among them decided under each key's lock, then
/// `UPDATE` by that id list (`RETURNING` on PostgreSQL and SQLite, a read back on MySQL).
pub fn claim<C: DibsConnection>(
    conn: &mut C,
    queue: &str,
    limit: usize,
    ttl: Duration,
) -> Result<Vec<ClaimedJob>> {
    validate::name("queue", queue)?;
    let micros = validate::ttl(ttl)?;
    let limit = check_limit(limit)?;
    let rows: Vec<JobRow> = dispatch!(conn, c => {
        bare_write_transaction(c, "claiming jobs", |c| {
            let syntax = c.syntax();
            // A paused queue yields no candidates (the pick's NOT EXISTS), in the same
            // statement: no extra round trip on the hot path.
            let candidates = statement(syntax.render(CLAIM_PICK))
                .bind::<Text, _>(queue)
                .bind::<Text, _>(queue)
                .bind::<BigInt, _>(limit)
                .load::<Candidate>(c)?;
            let ids = within_limits(c, candidates)?;
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            let mark = syntax.render(CLAIM_MARK);
            if syntax.returning {
                return Ok(statement(format!("{mark} RETURNING {CLAIMED_COLUMNS}"))
                    .bind::<BigInt, _>(micros)
                    .bind_ids(ids)
                    .load::<JobRow>(c)?);
            }
            statement(mark).bind::<BigInt, _>(micros).bind_ids(ids.iter().copied()).execute(c)?;
            Ok(statement(format!("SELECT {CLAIMED_COLUMNS} FROM dibs_jobs WHERE id IN {{ids}}"))
                .bind_ids(ids)
                .load::<JobRow>(c)?)
        })
    })?;
    let mut claimed = rows
        .into_iter()
        .map(ClaimedJob::from_row)
        .collect::<Result<Vec<_>>>()?;
    // The order the claim took them in (RETURNING has none).
    claimed.sort_by_key(|job| (job.priority, job.due_at, job.id));
    Ok(claimed)
}

/// Keeps the candidates without a limit key, and of each key as many as its limit allows
/// (deciding under the key's lock), in the candidates' order.
fn within_limits<C: DibsConnection>(conn: &mut C, candidates: Vec<Candidate>) -> Result<Vec<i64>> {
    let mut keys: Vec<&str> = candidates
        .iter()
        .filter_map(|c| c.limit_key.as_deref())
        .collect();
    if keys.is_empty() {
        return Ok(candidates.iter().map(|c| c.id).collect());
    }
    keys.sort_unstable();
    keys.dedup();
    let mut running: HashMap<&str, i64> = HashMap::new();
    for key in keys {
        let n = dispatch!(conn, c => {
            let syntax = c.syntax();
            let lock = match syntax.upsert {
                Upsert::OnConflictWhere => LIMIT_LOCK_ON_CONFLICT,
                Upsert::OnDuplicateKey => LIMIT_LOCK_ON_DUPLICATE_KEY,
            };
            statement(syntax.render(lock)).bind::<Text, _>(key).execute(c)?;
            statement(syntax.render(LIMIT_RUNNING))
                .bind::<Text, _>(key)
                .get_result::<manage::Count>(c)
        })?;
        running.insert(key, n.n);
    }
    let mut accepted = Vec::with_capacity(candidates.len());
    for candidate in &candidates {
        match (candidate.limit_key.as_deref(), candidate.limit_max) {
            (Some(key), Some(max)) => {
                let count = running.entry(key).or_insert(0);
                if *count < i64::from(max) {
                    *count += 1;
                    accepted.push(candidate.id);
                }
            }
            _ => accepted.push(candidate.id),
        }
    }
    Ok(accepted)
}

/// Returns stalled jobs (running, claim lapsed by the database's clock) to the queue, due at
/// once, up to `limit` per call. A lapsed claim uses no attempt (the worker may have died
/// before the run began: jobs it claimed ahead never started) but counts as a lapse: a job
/// whose claims lapsed [`MAX_LAPSES`] times is dead. A job asked to cancel while it ran is
/// cancelled. Needs a bare connection.
pub fn rescue<C: DibsConnection>(conn: &mut C, limit: usize) -> Result<Rescued> {
    let limit = check_limit(limit)?;
    let rows: Vec<IdStateRow> = dispatch!(conn, c => {
        bare_write_transaction(c, "rescuing stalled jobs", |c| {
            let syntax = c.syntax();
            let candidates: Vec<i64> = statement(syntax.render(RESCUE_CANDIDATES))
                .bind::<BigInt, _>(limit)
                .load::<IdRow>(c)
                .map(ids_of)?;
            if candidates.is_empty() {
                return Ok(Vec::new());
            }
            let mut ids = Vec::new();
            let locked = statement(syntax.render(RESCUE_LOCK))
                .bind_ids(candidates)
                .load::<LockedClaim>(c)?;
            for row in locked {
                let stalled = JobState::parse(&row.state)? == JobState::Running
                    && row.claim_expires_at.is_some_and(|at| at <= row.db_now);
                if stalled {
                    ids.push(row.id);
                }
            }
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            // The history names the run that lapsed: before the attempt is given back.
            for id in &ids {
                record_error(c, *id, None, RESCUE_ERROR)?;
            }
            statement(syntax.render(RESCUE_SET))
                .bind::<Integer, _>(MAX_LAPSES as i32)
                .bind::<Integer, _>(MAX_LAPSES as i32)
                .bind_ids(ids.iter().copied())
                .execute(c)?;
            Ok(statement("SELECT id, state FROM dibs_jobs WHERE id IN {ids}")
                .bind_ids(ids)
                .load::<IdStateRow>(c)?)
        })
    })?;
    let mut rescued = Rescued::default();
    for row in rows {
        match JobState::parse(&row.state)? {
            JobState::Waiting => rescued.requeued.push(row.id),
            JobState::Dead => rescued.dead.push(row.id),
            JobState::Cancelled => rescued.cancelled.push(row.id),
            // Not possible for rows this transaction locked and found stalled.
            JobState::Running | JobState::Completed => {}
        }
    }
    rescued.requeued.sort_unstable();
    rescued.dead.sort_unstable();
    rescued.cancelled.sort_unstable();
    Ok(rescued)
}

/// What a finishing call does to the jobs it may act on.
enum Finish<'a> {
    Complete,
    Renew(i64),
    GiveBack,
    Fail { error: &'a str, retry: Retry },
}

impl Finish<'_> {
    /// The state this call leaves a job in with the same token, to recognise a repeat.
    fn already_done(&self, state: JobState) -> bool {
        match self {
            Finish::Complete => state == JobState::Completed,
            Finish::GiveBack => state == JobState::Waiting,
            Finish::Fail { .. } => matches!(state, JobState::Waiting | JobState::Dead),
            Finish::Renew(_) => false,
        }
    }
}

fn check_claims(claims: &[JobClaim]) -> Result<()> {
    if claims.is_empty() {
        return Err(Error::invalid("claims", "an empty batch"));
    }
    if claims.len() > MAX_BATCH {
        return Err(Error::invalid(
            "claims",
            format!("more than {MAX_BATCH} in one call"),
        ));
    }
    let mut seen = HashSet::new();
    if let Some(dup) = claims.iter().find(|c| !seen.insert(c.id)) {
        return Err(Error::invalid(
            "claims",
            format!("job {} is listed twice", dup.id),
        ));
    }
    Ok(())
}

/// Locks the claimed rows, decides per job (Done if this token still holds it running,
/// AlreadyDone if this call was applied before, Lost otherwise), and applies `finish` to the
/// Done ones, in one transaction: the caller's (in a savepoint) or one of dibs's kind.
fn finish<C: DibsConnection>(
    conn: &mut C,
    claims: &[JobClaim],
    finish: Finish<'_>,
) -> Result<Vec<Outcome>> {
    check_claims(claims)?;
    transaction(conn, |conn| {
        let states: Vec<StateRow> = dispatch!(conn, c => {
            statement(c.syntax().render(LOCK_STATES))
                .bind_ids(claims.iter().map(|claim| claim.id))
                .load::<StateRow>(c)
        })?;
        let by_id: HashMap<i64, &StateRow> = states.iter().map(|row| (row.id, row)).collect();
        let mut outcomes = Vec::with_capacity(claims.len());
        let mut apply: Vec<&StateRow> = Vec::new();
        let mut cancel: Vec<&StateRow> = Vec::new();
        for claim in claims {
            let outcome = match by_id.get(&claim.id) {
                Some(row) if row.claim_token == Some(claim.token) => {
                    let state = JobState::parse(&row.state)?;
                    if state == JobState::Running && row.cancel_requested_at.is_some() {
                        // A renewal keeps the claim (and its limit slot) while the handler
                        // stops; every other end of the run cancels the job.
                        match finish {
                            Finish::Renew(_) => apply.push(row),
                            _ => cancel.push(row),
                        }
                        Outcome::Cancelled
                    } else if state == JobState::Running {
                        apply.push(row);
                        Outcome::Done
                    } else if state == JobState::Cancelled {
                        Outcome::Cancelled
                    } else if finish.already_done(state) {
                        Outcome::AlreadyDone
                    } else {
                        Outcome::Lost
                    }
                }
                _ => Outcome::Lost,
            };
            outcomes.push(outcome);
        }
        if !apply.is_empty() {
            apply_finish(conn, &apply, &finish)?;
        }
        if !cancel.is_empty() {
            let ids = cancel.iter().map(|row| row.id);
            dispatch!(conn, c => {
                statement(c.syntax().render(FINISH_CANCELLED)).bind_ids(ids).execute(c)
            })?;
        }
        Ok(outcomes)
    })
}

fn apply_finish<C: DibsConnection>(
    conn: &mut C,
    rows: &[&StateRow],
    finish: &Finish<'_>,
) -> Result<()> {
    let ids = rows.iter().map(|row| row.id);
    let batch_update = match finish {
        Finish::Complete => Some((COMPLETE, None)),
        Finish::GiveBack => Some((GIVE_BACK, None)),
        Finish::Renew(micros) => Some((RENEW, Some(*micros))),
        Finish::Fail { .. } => None,
    };
    match (batch_update, finish) {
        (Some((template, micros)), _) => {
            dispatch!(conn, c => {
                let sql = c.syntax().render(template);
                match micros {
                    Some(micros) => statement(sql).bind::<BigInt, _>(micros).bind_ids(ids).execute(c),
                    None => statement(sql).bind_ids(ids).execute(c),
                }
            })?;
        }
        (None, Finish::Complete | Finish::GiveBack | Finish::Renew(_)) => {}
        (None, Finish::Fail { error, retry }) => {
            let error = storable(error);
            let error = truncate(&error, MAX_ERROR_BYTES);
            for row in rows {
                let attempt = u32::try_from(row.attempt).unwrap_or(0);
                let exhausted = row.attempt >= row.max_attempts;
                let retry_at: Option<(Option<DateTime<Utc>>, i64)> = match retry {
                    _ if exhausted => None,
                    Retry::Never => None,
                    Retry::At(at) => Some((Some(*at), 0)),
                    Retry::After(delay) => Some((None, validate::delay_micros(*delay)?)),
                    Retry::Backoff(backoff) => {
                        Some((None, validate::delay_micros(backoff.jittered(attempt))?))
                    }
                };
                dispatch!(conn, c => {
                    let syntax = c.syntax();
                    match retry_at {
                        Some((at, micros)) => statement(syntax.render(FAIL_RETRY))
                            .bind::<Nullable<Instant>, _>(at)
                            .bind::<BigInt, _>(micros)
                            .bind::<Text, _>(error)
                            .bind::<BigInt, _>(row.id)
                            .execute(c),
                        None => statement(syntax.render(FAIL_DEAD))
                            .bind::<Text, _>(error)
                            .bind::<BigInt, _>(row.id)
                            .execute(c),
                    }
                })?;
                record_error(conn, row.id, Some(row.attempt), error)?;
            }
        }
    }
    Ok(())
}

/// Keeps the error of a failed run in the job's history (`attempt` None: the job's current
/// attempt), then trims the history to the newest [`MAX_ERROR_HISTORY`] entries.
fn record_error<C: DibsConnection>(
    conn: &mut C,
    id: i64,
    attempt: Option<i32>,
    error: &str,
) -> Result<()> {
    dispatch!(conn, c => {
        let syntax = c.syntax();
        statement(syntax.render(RECORD_ERROR))
            .bind::<Nullable<Integer>, _>(attempt)
            .bind::<Text, _>(error)
            .bind::<BigInt, _>(id)
            .execute(c)?;
        let cutoff = statement(syntax.render(ERROR_CUTOFF))
            .bind::<BigInt, _>(id)
            .get_result::<IdRow>(c)
            .optional()?;
        if let Some(cutoff) = cutoff {
            statement(syntax.render(TRIM_ERRORS))
                .bind::<BigInt, _>(id)
                .bind::<BigInt, _>(cutoff.id)
                .execute(c)?;
        }
        Ok::<(), Error>(())
    })
}

/// An error message any backend can store: PostgreSQL's text refuses NUL, which a panic
/// message or an error from C can hold; it becomes U+FFFD, the replacement character.
fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// Cuts `text` to at most `max` bytes at a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Marks claimed jobs completed. Inside the caller's transaction it commits (or rolls back)
/// with the handler's own writes: the exactly-once way to finish a job, provided the caller
/// rolls back when the outcome is not [`Outcome::Done`] (the call itself succeeds then).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use std::time::Duration;
/// # use dibs::jobs::{self, NewJob, Outcome};
/// # let mut conn = dibs::AnyConnection::connect(":memory:")?;
/// # dibs::run_migrations(&mut conn)?;
/// # jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))?;
/// let job = jobs::claim(&mut conn, "q", 1, Duration::from_secs(60))?.remove(0);
/// dibs::transaction(&mut conn, |conn| -> Result<(), Box<dyn std::error::Error>> {
///     // ... the handler's own writes on `conn` ...
///     let outcome = jobs::complete(conn, &[job.claim()])?;
///     if outcome != [Outcome::Done] {
///         // The claim was lost (or the job cancelled): roll the writes back with it.
///         return Err(format!("completion: {outcome:?}").into());
///     }
///     Ok(())
/// })?;
/// # Ok(()) }
/// ```
pub fn complete<C: DibsConnection>(conn: &mut C, claims: &[JobClaim]) -> Result<Vec<Outcome>> {
    finish(conn, claims, Finish::Complete)
}

/// Extends claims to the database's now + `ttl` (a heartbeat). `Lost` for a claim that was
/// rescued or taken over: the worker should stop.
pub fn renew<C: DibsConnection>(
    conn: &mut C,
    claims: &[JobClaim],
    ttl: Duration,
) -> Result<Vec<Outcome>> {
    let micros = validate::ttl(ttl)?;
    finish(conn, claims, Finish::Renew(micros))
}

/// Puts claimed jobs back, due at once; the run does not count as an attempt.
pub fn give_back<C: DibsConnection>(conn: &mut C, claims: &[JobClaim]) -> Result<Vec<Outcome>> {
    finish(conn, claims, Finish::GiveBack)
}

/// Records a failed run: with attempts left and a `retry` other than [`Retry::Never`], the
/// job waits for its retry; otherwise it is dead. The error (cut to
/// [`MAX_ERROR_BYTES`]) is kept with the job. A [`Retry::At`] outside the years 1 to 9999 or a
/// [`Retry::After`] longer than 366 days is [`Error::InvalidInput`], before any statement.
pub fn fail<C: DibsConnection>(
    conn: &mut C,
    claim: JobClaim,
    error: &str,
    retry: Retry,
) -> Result<Outcome> {
    validate::retry(&retry)?;
    let outcomes = finish(conn, &[claim], Finish::Fail { error, retry })?;
    Ok(outcomes.into_iter().next().unwrap_or(Outcome::Lost))
}

/// A job as stored, or `None` if there is no job with this id.
pub fn get<C: DibsConnection>(conn: &mut C, id: i64) -> Result<Option<Job>> {
    use crate::schema::dibs_jobs;
    Ok(dispatch!(conn, c => {
        dibs_jobs::table
            .find(id)
            .select(Job::as_select())
            .get_result(c)
            .optional()
    })?)
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

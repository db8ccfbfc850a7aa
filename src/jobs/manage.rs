//! Managing jobs: cancel, retry the dead, pause queues, read a job's history and the
//! queue's figures.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use super::{JobState, MAX_BATCH};
use crate::backend::statement::statement;
use crate::backend::{Dialect, Upsert, dispatch};
use crate::sql_types::{DatabaseNow, Instant};
use crate::transaction::write_turn;
use crate::{Error, Result, TenureConnection, validate};

/// A waiting job is cancelled at once. A running job is asked to: it stays running under its
/// claim (its handler is still running, and holds its limit key) until the worker, told at
/// its next heartbeat, records the run's end, which cancels it (or its claim lapses and the
/// rescue does). MySQL assigns left to right, reading the values assigned before: `state`
/// comes last, so every CASE reads the row's state as it was.
const CANCEL: &str = "\
    UPDATE tenure_jobs SET \
        finished_at = CASE WHEN state IN ('waiting', 'blocked') THEN {now} ELSE finished_at END, \
        cancel_requested_at = CASE WHEN state = 'running' THEN {now} \
            ELSE cancel_requested_at END, \
        state = CASE WHEN state IN ('waiting', 'blocked') THEN 'cancelled' ELSE state END \
    WHERE id = ? AND (state IN ('waiting', 'blocked') \
        OR (state = 'running' AND cancel_requested_at IS NULL))";

/// The state a cancel left, and whether others depend on the job.
const CANCELLED_STATE: &str = "SELECT state, dependents AS n FROM tenure_jobs WHERE id = ?";

#[derive(QueryableByName)]
struct CancelledState {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Integer)]
    n: i32,
}

const PAUSE_ON_CONFLICT: &str = "\
    INSERT INTO tenure_queue_pauses (queue, paused_at) VALUES (?, {now}) \
    ON CONFLICT (queue) DO NOTHING";
const PAUSE_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_queue_pauses (queue, paused_at) VALUES (?, {now}) \
    ON DUPLICATE KEY UPDATE queue = queue";

/// Counts per queue and state. Served by an index on (queue, state) (MySQL: the claim
/// index, whose first columns they are): an index-only scan, no table rows read.
const COUNTS: &str = "\
    SELECT queue, state, COUNT(*) AS n, MIN(due_at) AS oldest_due FROM tenure_jobs \
    GROUP BY queue, state";

/// Running jobs by lease deadline, from the stalled-claims index.
const RUNNING: &str = "\
    SELECT id, queue, kind, attempt, claim_expires_at FROM tenure_jobs \
    WHERE state = 'running' ORDER BY claim_expires_at LIMIT ?";

/// One failed run of a job, from [`history`]: the model of a `tenure_job_errors` row
/// ([`crate::schema::tenure_job_errors`]).
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = crate::schema::tenure_job_errors)]
pub struct FailedRun {
    /// Which run failed.
    pub attempt: i32,
    /// Its error (at most 4 KiB).
    pub error: String,
    /// When (database clock).
    pub failed_at: DateTime<Utc>,
}

/// The figures of one queue, from [`stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// The queue.
    pub queue: String,
    /// Jobs waiting for the jobs they depend on.
    pub blocked: i64,
    /// Jobs waiting (due now or later).
    pub waiting: i64,
    /// Jobs claimed.
    pub running: i64,
    /// Jobs completed (until pruned).
    pub completed: i64,
    /// Jobs dead.
    pub dead: i64,
    /// Jobs cancelled.
    pub cancelled: i64,
    /// How long the longest-waiting due job has waited (zero if none is due).
    pub oldest_waiting: chrono::Duration,
    /// Whether the queue is paused.
    pub paused: bool,
}

/// A claimed job and its lease deadline, from [`stats`].
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub struct RunningJob {
    /// The job's id.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// Its queue.
    #[diesel(sql_type = Text)]
    pub queue: String,
    /// Its kind.
    #[diesel(sql_type = Text)]
    pub kind: String,
    /// Which run.
    #[diesel(sql_type = Integer)]
    pub attempt: i32,
    /// When its claim lapses unless renewed.
    #[diesel(sql_type = Nullable<Instant>)]
    pub claim_expires_at: Option<DateTime<Utc>>,
}

/// What [`stats`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// The database's clock when read.
    pub now: DateTime<Utc>,
    /// Per queue, by name.
    pub queues: Vec<QueueStats>,
    /// Claimed jobs, soonest lease deadline first (at most 1,000).
    pub running: Vec<RunningJob>,
}

#[derive(QueryableByName)]
struct CountRow {
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Nullable<Instant>)]
    oldest_due: Option<DateTime<Utc>>,
}

#[derive(QueryableByName)]
struct QueueRow {
    #[diesel(sql_type = Text)]
    queue: String,
}

#[derive(QueryableByName)]
pub(crate) struct Count {
    #[diesel(sql_type = BigInt)]
    pub n: i64,
}

/// Cancels a waiting job, or asks a running one to cancel; returns whether it did (false:
/// finished, gone, or asked already). A running job stays running (and keeps its limit
/// key) until its run ends: the worker learns at its next heartbeat
/// ([`super::Outcome::Cancelled`]), raises the handler's `should_stop`, and when the handler
/// returns the job is cancelled, whatever the run's result; if the worker is gone, the
/// rescue of its lapsed claim cancels it. Joins the caller's transaction if there is one.
///
/// A blocked job is cancelled at once too. The jobs that depend on a cancelled job follow
/// their [`super::RunWhen`] in the same transaction.
pub fn cancel<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    let (changed, released) = crate::transaction::retrying_transaction(conn, |conn| {
        if !cancel_locked(conn, id)? {
            return Ok::<_, Error>((false, Vec::new()));
        }
        let now: CancelledState = dispatch!(conn, c => {
            statement(CANCELLED_STATE).bind::<BigInt, _>(id).get_result::<CancelledState>(c)
        })?;
        let released = if now.state == "cancelled" && now.n != 0 {
            super::settle(conn, vec![(id, JobState::Cancelled)])?
        } else {
            Vec::new()
        };
        Ok((true, released))
    })?;
    crate::wake::wake(released.iter().map(String::as_str));
    Ok(changed)
}

/// The cancel statement alone (no settling of dependents): whether it changed the job.
pub(super) fn cancel_locked<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    let changed = dispatch!(conn, c => {
        statement(c.syntax().render(CANCEL)).bind::<BigInt, _>(id).execute(c)
    })?;
    Ok(changed == 1)
}

/// Makes a dead job wait again, due at once, with its attempts counted from zero. Returns
/// whether it was dead. Refused ([`Error::InvalidInput`]) if a live job of its queue has the
/// same dedup key.
///
/// Jobs still blocked that counted its death as finished ([`super::RunWhen::AllFinished`])
/// wait for it again; those its death already cancelled or released stay so.
pub fn retry_dead<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    use crate::schema::tenure_jobs;
    crate::transaction::retrying_transaction(conn, |conn| {
        let changed = dispatch!(conn, c => {
            diesel::update(tenure_jobs::table.find(id).filter(tenure_jobs::state.eq(JobState::Dead)))
                .set(retried())
                .execute(c)
        })
        .map_err(dedup_conflict)?;
        if changed == 1 {
            super::dependencies::rearm(conn, &[id])?;
        }
        Ok(changed == 1)
    })
}

/// [`retry_dead`] for every dead job of a queue and kind; returns how many. All or none: if
/// one of them would duplicate a live job's dedup key, none is retried.
pub fn retry_dead_of_kind<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    kind: &str,
) -> Result<usize> {
    validate::name("queue", queue)?;
    validate::name("kind", kind)?;
    use crate::schema::tenure_jobs;
    crate::transaction::retrying_transaction(conn, |conn| {
        let dead = || {
            tenure_jobs::table
                .filter(tenure_jobs::state.eq(JobState::Dead))
                .filter(tenure_jobs::queue.eq(queue))
                .filter(tenure_jobs::kind.eq(kind))
        };
        // Those that blocked jobs may have counted as finished.
        let with_dependents: Vec<i64> = dispatch!(conn, c => {
            dead().filter(tenure_jobs::dependents.gt(0)).select(tenure_jobs::id).order(tenure_jobs::id).load(c)
        })?;
        let changed = dispatch!(conn, c => diesel::update(dead()).set(retried()).execute(c))
            .map_err(dedup_conflict)?;
        super::dependencies::rearm(conn, &with_dependents)?;
        Ok(changed)
    })
}

/// A dead job runs again from its first attempt (no lapses, no snoozes), due at once
/// (database clock).
#[allow(clippy::type_complexity)]
fn retried() -> (
    diesel::dsl::Eq<crate::schema::tenure_jobs::state, JobState>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::attempt, i32>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::lapses, i32>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::snoozes, i32>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::due_at, DatabaseNow>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::finished_at, Option<DateTime<Utc>>>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::claim_token, Option<uuid::Uuid>>,
    diesel::dsl::Eq<crate::schema::tenure_jobs::claim_expires_at, Option<DateTime<Utc>>>,
) {
    use crate::schema::tenure_jobs::*;
    (
        state.eq(JobState::Waiting),
        attempt.eq(0),
        lapses.eq(0),
        snoozes.eq(0),
        due_at.eq(DatabaseNow),
        finished_at.eq(None),
        claim_token.eq(None),
        claim_expires_at.eq(None),
    )
}

fn dedup_conflict(error: diesel::result::Error) -> Error {
    match error {
        diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::UniqueViolation,
            _,
        ) => Error::invalid("job", "a live job of its queue has the same dedup key"),
        other => Error::Database(other),
    }
}

/// Pauses a queue: claims skip it (enqueues still work) until [`resume`]. Idempotent.
pub fn pause<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<()> {
    validate::name("queue", queue)?;
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    dispatch!(conn, c => {
        let syntax = c.syntax();
        let sql = match syntax.upsert {
            Upsert::OnConflictWhere => PAUSE_ON_CONFLICT,
            Upsert::OnDuplicateKey => PAUSE_ON_DUPLICATE_KEY,
        };
        statement(syntax.render(sql)).bind::<Text, _>(queue).execute(c)
    })?;
    Ok(())
}

/// Resumes a paused queue. Idempotent.
pub fn resume<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<()> {
    validate::name("queue", queue)?;
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    use crate::schema::tenure_queue_pauses;
    dispatch!(conn, c => diesel::delete(tenure_queue_pauses::table.find(queue)).execute(c))?;
    Ok(())
}

/// Whether a queue is paused.
pub fn is_paused<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<bool> {
    validate::name("queue", queue)?;
    use crate::schema::tenure_queue_pauses;
    let paused: i64 = dispatch!(conn, c => {
        tenure_queue_pauses::table
            .filter(tenure_queue_pauses::queue.eq(queue))
            .count()
            .get_result(c)
    })?;
    Ok(paused > 0)
}

/// The errors of a job's failed runs, oldest first (the newest
/// [`MAX_ERROR_HISTORY`](super::MAX_ERROR_HISTORY) are kept).
pub fn history<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<FailedRun>> {
    use crate::schema::tenure_job_errors;
    Ok(dispatch!(conn, c => {
        tenure_job_errors::table
            .filter(tenure_job_errors::job_id.eq(id))
            .order(tenure_job_errors::id)
            .select(FailedRun::as_select())
            .load(c)
    })?)
}

/// Counts per queue and state, the age of each queue's longest-waiting due job, which queues
/// are paused, and the claimed jobs with their lease deadlines.
pub fn stats<C: TenureConnection>(conn: &mut C) -> Result<Stats> {
    let now = crate::database_now(conn)?;
    let (counts, paused, running) = dispatch!(conn, c => {
        let counts = statement(COUNTS).load::<CountRow>(c)?;
        let paused = statement("SELECT queue FROM tenure_queue_pauses").load::<QueueRow>(c)?;
        let running = statement(c.syntax().render(RUNNING))
            .bind::<BigInt, _>(MAX_BATCH as i64)
            .load::<RunningJob>(c)?;
        Ok::<_, Error>((counts, paused, running))
    })?;
    let mut queues: std::collections::BTreeMap<String, QueueStats> = Default::default();
    for row in counts {
        let entry = queues
            .entry(row.queue.clone())
            .or_insert_with(|| QueueStats {
                queue: row.queue.clone(),
                ..QueueStats::default()
            });
        match JobState::parse(&row.state)? {
            JobState::Waiting => {
                entry.waiting = row.n;
                if let Some(oldest) = row.oldest_due {
                    entry.oldest_waiting = (now - oldest).max(chrono::Duration::zero());
                }
            }
            JobState::Blocked => entry.blocked = row.n,
            JobState::Running => entry.running = row.n,
            JobState::Completed => entry.completed = row.n,
            JobState::Dead => entry.dead = row.n,
            JobState::Cancelled => entry.cancelled = row.n,
        }
    }
    for QueueRow { queue } in paused {
        queues
            .entry(queue.clone())
            .or_insert_with(|| QueueStats {
                queue,
                ..QueueStats::default()
            })
            .paused = true;
    }
    Ok(Stats {
        now,
        queues: queues.into_values().collect(),
        running,
    })
}

/// Which jobs [`list`] returns: every field set narrows the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFilter {
    /// Only these jobs (at most [`MAX_BATCH`] ids).
    pub ids: Option<Vec<i64>>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only jobs with this dedup key.
    pub dedup_key: Option<String>,
    /// At most this many (1 to [`MAX_BATCH`]; default 100), newest first.
    pub limit: usize,
}

impl Default for JobFilter {
    fn default() -> Self {
        JobFilter {
            ids: None,
            queue: None,
            state: None,
            kind: None,
            dedup_key: None,
            limit: 100,
        }
    }
}

/// Jobs matching `filter`, newest (highest id) first. Built with diesel's query builder on
/// [`crate::schema::tenure_jobs`]: for other filters, query the table yourself.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, JobFilter, JobState, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// jobs::enqueue(&mut conn, &NewJob::new("mail", "welcome", vec![]).dedup_key("user-7"))?;
/// let waiting = jobs::list(&mut conn, &JobFilter { queue: Some("mail".into()), state: Some(JobState::Waiting), ..JobFilter::default() })?;
/// assert_eq!(waiting.len(), 1);
/// let by_key = jobs::list(&mut conn, &JobFilter { dedup_key: Some("user-7".into()), ..JobFilter::default() })?;
/// assert_eq!(by_key[0].id, waiting[0].id);
/// # Ok(()) }
/// ```
pub fn list<C: TenureConnection>(conn: &mut C, filter: &JobFilter) -> Result<Vec<super::Job>> {
    use crate::schema::tenure_jobs;
    if filter.limit == 0 || filter.limit > MAX_BATCH {
        return Err(Error::invalid(
            "limit",
            format!("{} is not between 1 and {MAX_BATCH}", filter.limit),
        ));
    }
    if let Some(ids) = &filter.ids {
        if ids.len() > MAX_BATCH {
            return Err(Error::invalid(
                "ids",
                format!("{} ids, the most is {MAX_BATCH}", ids.len()),
            ));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
    }
    if let Some(queue) = &filter.queue {
        validate::name("queue", queue)?;
    }
    if let Some(kind) = &filter.kind {
        validate::name("kind", kind)?;
    }
    if let Some(key) = &filter.dedup_key {
        validate::name("dedup key", key)?;
    }
    Ok(dispatch!(conn, c => {
        let mut query = tenure_jobs::table.select(super::Job::as_select()).into_boxed();
        if let Some(ids) = &filter.ids {
            query = query.filter(tenure_jobs::id.eq_any(ids));
        }
        if let Some(queue) = &filter.queue {
            query = query.filter(tenure_jobs::queue.eq(queue));
        }
        if let Some(state) = filter.state {
            query = query.filter(tenure_jobs::state.eq(state));
        }
        if let Some(kind) = &filter.kind {
            query = query.filter(tenure_jobs::kind.eq(kind));
        }
        if let Some(key) = &filter.dedup_key {
            query = query.filter(tenure_jobs::dedup_key.eq(key));
        }
        query
            .order(tenure_jobs::id.desc())
            .limit(filter.limit as i64)
            .load(c)
    })?)
}

/// What one run printed and how it ended, from [`outputs`]: the model of a
/// `tenure_job_outputs` row ([`crate::schema::tenure_job_outputs`]).
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = crate::schema::tenure_job_outputs)]
pub struct RunOutput {
    /// Which run.
    pub attempt: i32,
    /// Its exit code, if it exited with one.
    pub exit_code: Option<i32>,
    /// What it printed (at most [`MAX_OUTPUT_BYTES`]).
    pub output: Vec<u8>,
    /// When it was recorded (database clock).
    pub finished_at: DateTime<Utc>,
}

/// The most output kept per run; longer output keeps its last bytes.
pub const MAX_OUTPUT_BYTES: usize = 64 * 1024;

const RECORD_OUTPUT: &str = "\
    INSERT INTO tenure_job_outputs (job_id, attempt, exit_code, output, finished_at) \
    VALUES (?, ?, ?, ?, {now})";

/// Keeps what a run of job `id` printed and its exit code with the job (the tail of the
/// output, at most [`MAX_OUTPUT_BYTES`]). Joins the caller's transaction if there is one.
/// Outputs are deleted with their job when it is pruned.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("ops", "shell", vec![]))?.id;
/// jobs::record_output(&mut conn, id, 1, Some(0), b"backup done\n")?;
/// let runs = jobs::outputs(&mut conn, id)?;
/// assert_eq!((runs[0].exit_code, runs[0].output.as_slice()), (Some(0), &b"backup done\n"[..]));
/// # Ok(()) }
/// ```
pub fn record_output<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    attempt: u32,
    exit_code: Option<i32>,
    output: &[u8],
) -> Result<()> {
    let tail = &output[output.len().saturating_sub(MAX_OUTPUT_BYTES)..];
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    dispatch!(conn, c => {
        statement(c.syntax().render(RECORD_OUTPUT))
            .bind::<BigInt, _>(id)
            .bind::<Integer, _>(attempt as i32)
            .bind::<Nullable<Integer>, _>(exit_code)
            .bind::<diesel::sql_types::Binary, _>(tail)
            .execute(c)
    })?;
    Ok(())
}

/// The recorded outputs of job `id`'s runs, oldest first.
pub fn outputs<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<RunOutput>> {
    use crate::schema::tenure_job_outputs;
    Ok(dispatch!(conn, c => {
        tenure_job_outputs::table
            .filter(tenure_job_outputs::job_id.eq(id))
            .order(tenure_job_outputs::id)
            .select(RunOutput::as_select())
            .load(c)
    })?)
}

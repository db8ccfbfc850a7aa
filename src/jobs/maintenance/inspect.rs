//! Reading the queue: one job ([`get`]), a filtered list of jobs ([`list`]), a job's failed
//! runs ([`history`]), and the whole picture per queue and state ([`stats`]).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::jobs::Job;
use crate::jobs::{JobState, MAX_BATCH};
use crate::rows::QueueRow;
use crate::sql_types::Instant;
use crate::{Error, Result, TenureConnection, validate};

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
    /// Jobs parked until something outside answers them ([`crate::jobs::ParkToken`]).
    pub parked: i64,
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

/// The errors of a job's failed runs, oldest first (the newest
/// [`MAX_ERROR_HISTORY`](crate::jobs::MAX_ERROR_HISTORY) are kept).
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
            JobState::Parked => entry.parked = row.n,
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
pub fn list<C: TenureConnection>(
    conn: &mut C,
    filter: &JobFilter,
) -> Result<Vec<crate::jobs::Job>> {
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
        let mut query = tenure_jobs::table.select(crate::jobs::Job::as_select()).into_boxed();
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

/// A job as stored, or `None` if there is no job with this id.
pub fn get<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<Job>> {
    use crate::schema::tenure_jobs;
    Ok(dispatch!(conn, c => {
        tenure_jobs::table
            .find(id)
            .select(Job::as_select())
            .get_result(c)
            .optional()
    })?)
}

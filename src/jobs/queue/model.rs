//! The queue's values: a job as stored and its state, what a claim hands out, what a call
//! reports, and the rows claims and finishes read.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::backend::Backend;
use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::serialize::{self, Output, ToSql};
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};
use diesel::{Queryable, QueryableByName, Selectable};
use uuid::Uuid;

use crate::sql_types::{Instant, Token};
use crate::{Error, Result, validate};

/// Where a job is in its life. Stored as text (`tenure_jobs.state`); usable in diesel queries:
/// `tenure_jobs::state.eq(JobState::Waiting)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
pub enum JobState {
    /// Waiting for the jobs it depends on ([`crate::jobs::NewJob::depends_on`]): not claimable
    /// until they finish as its [`crate::jobs::RunWhen`] asks.
    Blocked,
    /// Waiting to be claimed, now or at its due time (retries included).
    Waiting,
    /// Claimed by a worker, until its claim expires.
    Running,
    /// Parked until something outside answers it with its token
    /// ([`crate::jobs::ParkToken`]: completed, failed or resumed) or its deadline passes:
    /// not claimable, not finished, holding no claim and no concurrency slot.
    Parked,
    /// Done.
    Completed,
    /// Failed for good: no attempts left, or a handler said not to retry.
    Dead,
    /// Cancelled by an operator before it finished.
    Cancelled,
}

impl JobState {
    /// The state as stored: `blocked`, `waiting`, `running`, `parked`, `completed`, `dead`
    /// or `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Blocked => "blocked",
            JobState::Waiting => "waiting",
            JobState::Running => "running",
            JobState::Parked => "parked",
            JobState::Completed => "completed",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Whether the job has finished (completed, dead or cancelled).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Dead | JobState::Cancelled
        )
    }

    pub(crate) fn parse(text: &str) -> Result<JobState> {
        match text {
            "blocked" => Ok(JobState::Blocked),
            "waiting" => Ok(JobState::Waiting),
            "running" => Ok(JobState::Running),
            "parked" => Ok(JobState::Parked),
            "completed" => Ok(JobState::Completed),
            "dead" => Ok(JobState::Dead),
            "cancelled" => Ok(JobState::Cancelled),
            other => Err(Error::Database(
                diesel::result::Error::DeserializationError(
                    format!("unknown job state {other:?}").into(),
                ),
            )),
        }
    }
}

impl<DB: Backend> FromSql<Text, DB> for JobState
where
    String: FromSql<Text, DB>,
{
    fn from_sql(bytes: DB::RawValue<'_>) -> deserialize::Result<Self> {
        let text = <String as FromSql<Text, DB>>::from_sql(bytes)?;
        JobState::parse(&text).map_err(|e| e.to_string().into())
    }
}

impl<DB: Backend> ToSql<Text, DB> for JobState
where
    str: ToSql<Text, DB>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
        <str as ToSql<Text, DB>>::to_sql(self.as_str(), out)
    }
}

/// What identifies one claim of a job: its id and the claim's token. Every call that
/// finishes or extends a claim is fenced by both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct JobClaim {
    /// The job's id.
    pub id: i64,
    /// The token of this claim.
    pub token: Uuid,
}

/// A job handed out by [`crate::jobs::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedJob {
    /// The job's id.
    pub id: i64,
    /// Its queue.
    pub queue: String,
    /// Its kind (which handler runs it).
    pub kind: String,
    /// Its payload, byte for byte.
    pub payload: Vec<u8>,
    /// Its priority.
    pub priority: i32,
    /// Which run this is: 1 for the first.
    pub attempt: u32,
    /// How many runs it may have.
    pub max_attempts: u32,
    /// The token of this claim.
    pub token: Uuid,
    /// When it was due.
    pub due_at: DateTime<Utc>,
    /// When it was enqueued (database clock).
    pub created_at: DateTime<Utc>,
    /// When this claim was made (database clock).
    pub claimed_at: DateTime<Utc>,
    /// When the claim lapses unless renewed (database clock).
    pub claim_expires_at: DateTime<Utc>,
    /// Lapses counted against it before this claim ([`crate::jobs::MAX_LAPSES`]). A worker
    /// runs a job with lapses alone among such jobs, and records its start first: a crash
    /// during that run is charged to it, and not to the jobs claimed ahead beside it.
    pub lapses: u32,
}

impl ClaimedJob {
    /// The id and token that fence calls about this claim.
    pub fn claim(&self) -> JobClaim {
        JobClaim {
            id: self.id,
            token: self.token,
        }
    }

    /// The payload read as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| Error::invalid("payload", format!("is not the JSON expected: {e}")))
    }

    pub(crate) fn from_row(row: JobRow) -> Result<ClaimedJob> {
        let broken = |what: &str| {
            Error::Database(diesel::result::Error::DeserializationError(
                format!("a claimed job without {what}").into(),
            ))
        };
        Ok(ClaimedJob {
            token: row.claim_token.ok_or_else(|| broken("a claim token"))?,
            claim_expires_at: row
                .claim_expires_at
                .ok_or_else(|| broken("a claim expiry"))?,
            claimed_at: row.claimed_at.ok_or_else(|| broken("a claim time"))?,
            created_at: row.created_at,
            id: row.id,
            queue: row.queue,
            kind: row.kind,
            payload: row.payload,
            priority: row.priority,
            attempt: u32::try_from(row.attempt).unwrap_or(0),
            max_attempts: u32::try_from(row.max_attempts).unwrap_or(0),
            due_at: row.due_at,
            lapses: u32::try_from(row.lapses).unwrap_or(0),
        })
    }
}

/// A job as stored: the model of a `tenure_jobs` row ([`crate::schema::tenure_jobs`]), from
/// [`crate::jobs::get`] and [`crate::jobs::list`], and for your own queries:
/// `tenure_jobs::table.select(Job::as_select())`.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable)]
#[diesel(table_name = crate::schema::tenure_jobs)]
pub struct Job {
    /// Its id.
    pub id: i64,
    /// Its queue.
    pub queue: String,
    /// Its kind.
    pub kind: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Its priority.
    pub priority: i32,
    /// Its state.
    pub state: JobState,
    /// Runs started so far.
    #[diesel(deserialize_as = i32)]
    pub attempt: u32,
    /// Runs allowed.
    #[diesel(deserialize_as = i32)]
    pub max_attempts: u32,
    /// When it is (or was) due.
    pub due_at: DateTime<Utc>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When its current (or last) claim was made.
    pub claimed_at: Option<DateTime<Utc>>,
    /// When the current claim lapses, while running.
    pub claim_expires_at: Option<DateTime<Utc>>,
    /// When it completed or died.
    pub finished_at: Option<DateTime<Utc>>,
    /// The error of the last failed run.
    pub last_error: Option<String>,
    /// Its dedup key, if it has one.
    pub dedup_key: Option<String>,
    /// How many enqueues its dedup key folded into it.
    pub dedup_hits: i64,
    /// Its concurrency-limit key, if it has one.
    pub limit_key: Option<String>,
    /// The most jobs of its limit key that run at once.
    pub limit_max: Option<i32>,
    /// Lapses charged to it (its worker died or stalled): its first, then those of runs that
    /// began; dead at [`crate::jobs::MAX_LAPSES`].
    #[diesel(deserialize_as = i32)]
    pub lapses: u32,
    /// When a cancel was asked for while it ran: it stays running until its worker stops the
    /// run (or the claim lapses), then it is cancelled.
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// How often its runs were snoozed ([`crate::jobs::snooze`]); past
    /// [`crate::jobs::MAX_FREE_SNOOZES`] a snooze uses an attempt.
    #[diesel(deserialize_as = i32)]
    pub snoozes: u32,
    /// How long after it finishes it still folds enqueues of its dedup key, in microseconds
    /// (the largest [`NewJob::dedup_window`](crate::jobs::NewJob::dedup_window) of the enqueues
    /// folded into it); `None`: only while live. [`crate::jobs::prune`] keeps it until then.
    pub dedup_window_micros: Option<i64>,
    /// The workflow it belongs to ([`crate::jobs::Workflow`]), if any.
    pub workflow_id: Option<i64>,
    /// With dependencies: when it runs ([`crate::jobs::RunWhen`]).
    pub run_when: Option<crate::jobs::RunWhen>,
    /// What it last reported of its progress while running ([`crate::jobs::record_progress`]),
    /// with a message.
    pub progress: Option<f64>,
    /// The message of that progress.
    pub progress_message: Option<String>,
    /// Its sequence key ([`crate::jobs::NewJob::sequence`]), if it has one.
    pub sequence_key: Option<String>,
}

/// What a call about one claimed job did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Done now.
    Done,
    /// This same call with this same token was already applied (a retried call after a lost
    /// reply): nothing changed now.
    AlreadyDone,
    /// The claim is no longer this token's (it lapsed and was rescued, or another worker
    /// holds the job now, or the job is gone): nothing changed. Stop working on it.
    Lost,
    /// The job was cancelled while this token held it: nothing changed. Stop working on it.
    Cancelled,
}

/// What to do with a failed run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Retry {
    /// Retry after an exponential backoff with jitter, until the job's attempts run out.
    Backoff(Backoff),
    /// Retry after this long (attempts permitting).
    After(Duration),
    /// Retry at this instant (attempts permitting): from year 1 to year 9999, like
    /// [`NewJob::at`](crate::jobs::NewJob::at); [`crate::jobs::fail`] refuses others with [`Error::InvalidInput`].
    At(DateTime<Utc>),
    /// Do not retry: the job is dead now.
    Never,
}

impl Default for Retry {
    fn default() -> Self {
        Retry::Backoff(Backoff::default())
    }
}

impl Retry {
    /// What to do with a failed run: an instant within the years 1 to 9999
    /// ([`validate::instant`]), a delay of at most [`crate::MAX_TTL`]. (A backoff's delay
    /// depends on the attempt and is checked when it is computed.)
    pub(crate) fn check(&self) -> Result<()> {
        match self {
            Retry::At(at) => validate::instant("retry at", *at),
            Retry::After(delay) => validate::delay_micros(*delay).map(|_| ()),
            Retry::Backoff(_) | Retry::Never => Ok(()),
        }
    }
}

/// Exponential backoff: `base * 2^(attempt - 1)`, at most `max`, then a random jitter that
/// keeps between half and all of it (so failed jobs do not all come back at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failed run (default 1 s).
    pub base: Duration,
    /// The longest delay (default 1 hour).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(3600),
        }
    }
}

impl Backoff {
    /// The delay after failed run number `attempt` (1-based), before jitter.
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 2u32.saturating_pow(attempt.saturating_sub(1).min(30));
        self.base.saturating_mul(factor).min(self.max)
    }

    pub(crate) fn jittered(&self, attempt: u32) -> Duration {
        self.delay(attempt).mul_f64(rand::random_range(0.5..=1.0))
    }
}

/// What [`crate::jobs::rescue`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rescued {
    /// Jobs whose claim lapsed (or whose worker died), back in the queue and due at once.
    pub requeued: Vec<i64>,
    /// Jobs whose claim lapsed for the [`crate::jobs::MAX_LAPSES`]th time: dead.
    pub dead: Vec<i64>,
    /// Jobs asked to cancel while they ran, whose claim then lapsed: cancelled.
    pub cancelled: Vec<i64>,
}

/// A claimed job's row, as the claim reads it back.
#[derive(QueryableByName)]
pub(crate) struct JobRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub queue: String,
    #[diesel(sql_type = Text)]
    pub kind: String,
    #[diesel(sql_type = Binary)]
    pub payload: Vec<u8>,
    #[diesel(sql_type = Integer)]
    pub priority: i32,
    #[diesel(sql_type = Integer)]
    pub attempt: i32,
    #[diesel(sql_type = Integer)]
    pub max_attempts: i32,
    #[diesel(sql_type = Instant)]
    pub due_at: DateTime<Utc>,
    #[diesel(sql_type = Instant)]
    pub created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Token>)]
    pub claim_token: Option<Uuid>,
    #[diesel(sql_type = Nullable<Instant>)]
    pub claimed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Instant>)]
    pub claim_expires_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Integer)]
    pub lapses: i32,
}

/// What finishing calls read (and lock) before deciding.
#[derive(QueryableByName)]
pub(crate) struct StateRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = Nullable<Token>)]
    pub claim_token: Option<Uuid>,
    #[diesel(sql_type = Integer)]
    pub attempt: i32,
    #[diesel(sql_type = Integer)]
    pub max_attempts: i32,
    #[diesel(sql_type = Integer)]
    pub snoozes: i32,
    #[diesel(sql_type = Nullable<Instant>)]
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// 1 once a job depends on it.
    #[diesel(sql_type = Integer)]
    pub dependents: i32,
}

/// A claim candidate: `limit_key` says it has limits (`tenure_job_limits`).
#[derive(QueryableByName)]
pub(crate) struct Candidate {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Integer)]
    pub priority: i32,
    #[diesel(sql_type = BigInt)]
    pub fair_stamp: i64,
    #[diesel(sql_type = Instant)]
    pub due_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    pub limit_key: Option<String>,
    /// The job's slot (PostgreSQL's job slots; 0 elsewhere).
    #[diesel(sql_type = BigInt)]
    pub job_slot: i64,
}

/// Where a job stands in claim order: priority, fair stamp, due time, id (the pick's ORDER BY).
pub(crate) type ClaimOrder = (i32, i64, DateTime<Utc>, i64);

impl Candidate {
    /// This candidate's place in claim order.
    pub(crate) fn claim_order(&self) -> ClaimOrder {
        (self.priority, self.fair_stamp, self.due_at, self.id)
    }
}

#[derive(QueryableByName)]
pub(crate) struct InsertedRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = BigInt)]
    pub dedup_hits: i64,
    /// The row's state after the upsert (which never changes a state).
    #[diesel(sql_type = Text)]
    pub state: String,
    /// The row's kind (an upsert applies a mode only to a job of the same kind).
    #[diesel(sql_type = Text)]
    pub kind: String,
}

/// A rescue candidate as locked: is it still a lapsed claim?
#[derive(QueryableByName)]
pub(crate) struct LockedClaim {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = Nullable<Instant>)]
    pub claim_expires_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Instant)]
    pub db_now: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_checked_like_instants_and_delays() {
        assert!(Retry::At(DateTime::<Utc>::MAX_UTC).check().is_err());
        assert!(
            Retry::After(crate::MAX_TTL + Duration::from_secs(1))
                .check()
                .is_err()
        );
        assert!(Retry::Never.check().is_ok());
    }
}

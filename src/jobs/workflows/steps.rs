//! Durable steps (`tenure_steps`): a step's result committed in the transaction of the
//! step's own writes, under the run's claim, and read back instead of running the step again
//! when the job is retried.

use std::fmt;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Nullable, Text};
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::results::MAX_RESULT_BYTES;
use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::jobs::{JobClaim, JobState};
use crate::schema::{tenure_jobs, tenure_steps};
use crate::sql_types::{DatabaseNow, Instant, Token};
use crate::{AnyConnection, Error, Result, TenureConnection, validate};

/// A completed step of a job, from [`steps`]: the model of a `tenure_steps` row
/// ([`crate::schema::tenure_steps`]).
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = crate::schema::tenure_steps)]
pub struct JobStep {
    /// The step's name.
    pub name: String,
    /// Its result, as JSON (at most [`MAX_RESULT_BYTES`]).
    pub result: Vec<u8>,
    /// When it committed (database clock).
    pub created_at: DateTime<Utc>,
}

impl JobStep {
    /// Its result, decoded.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T> {
        decode_step(&self.name, &self.result)
    }
}

/// Why a step did not give its result: its closure failed ([`StepError::Failed`], with the
/// closure's own error), or tenure refused or could not commit it ([`StepError::Tenure`]:
/// [`Error::ClaimLost`], a result too long or not JSON ([`Error::InvalidInput`]), a
/// database error). In both cases nothing of the step was committed.
///
/// In a handler, `?` turns it into a [`JobError`](crate::worker::JobError): the closure's
/// own `JobError` as it was (a [`JobError::dead`](crate::worker::JobError::dead) stays
/// dead), tenure's error as a retry per policy. It is not a `std::error::Error` (that would
/// make `?` in a handler a plain retry, losing the closure's own action): elsewhere,
/// `.map_err(|e| e.to_string())` or match it.
pub enum StepError<E> {
    /// The closure returned this error: its writes were rolled back, nothing stored.
    Failed(E),
    /// tenure could not store the step (the closure's writes were rolled back with it).
    Tenure(Error),
}

impl<E> StepError<E> {
    /// tenure's error, if it is one.
    pub fn tenure_error(&self) -> Option<&Error> {
        match self {
            StepError::Tenure(e) => Some(e),
            StepError::Failed(_) => None,
        }
    }

    /// Whether the run had lost its claim ([`Error::ClaimLost`]).
    pub fn is_claim_lost(&self) -> bool {
        matches!(self, StepError::Tenure(Error::ClaimLost { .. }))
    }

    /// The closure's error as another type (what [`crate::worker::JobContext::step`] does).
    pub fn map_failed<F>(self, f: impl FnOnce(E) -> F) -> StepError<F> {
        match self {
            StepError::Failed(e) => StepError::Failed(f(e)),
            StepError::Tenure(e) => StepError::Tenure(e),
        }
    }
}

impl<E> From<Error> for StepError<E> {
    fn from(error: Error) -> Self {
        StepError::Tenure(error)
    }
}

impl<E: fmt::Debug> fmt::Debug for StepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Failed(e) => f.debug_tuple("Failed").field(e).finish(),
            StepError::Tenure(e) => f.debug_tuple("Tenure").field(e).finish(),
        }
    }
}

impl<E: fmt::Display> fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Failed(e) => write!(f, "the step failed: {e}"),
            StepError::Tenure(e) => write!(f, "the step was not stored: {e}"),
        }
    }
}

/// What ended a step's transaction without a commit.
enum Abort<E> {
    Closure(E),
    Tenure(Error),
    /// Another call of this run stored the step first (two threads, one name).
    StoredMeanwhile,
    /// A test context kept this step from another thread first: its result.
    KeptMeanwhile(Vec<u8>),
}

impl<E> From<DieselError> for Abort<E> {
    fn from(error: DieselError) -> Self {
        Abort::Tenure(error.into())
    }
}

impl<E> From<Error> for Abort<E> {
    fn from(error: Error) -> Self {
        Abort::Tenure(error)
    }
}

/// The job row, locked until the step's transaction ends: a rescue or a new claim (which
/// change the token) waits for it, so none slips between this check and the commit.
/// SQLite: `{for_update}` is empty; the IMMEDIATE transaction holds the database's write lock.
const LOCK_CLAIM: &str =
    "SELECT state, claim_token, cancel_requested_at FROM tenure_jobs WHERE id = ?{for_update}";

#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<Token>)]
    claim_token: Option<Uuid>,
    #[diesel(sql_type = Nullable<Instant>)]
    cancel_requested_at: Option<DateTime<Utc>>,
}

/// Whether a job row (state, token, cancel request) is still `claim`'s run: running under
/// its token and not asked to cancel (a run asked to cancel ends cancelled whatever it does,
/// so a step of it would commit into a cancelled job: refused, as a park is).
fn holds(claim: JobClaim, state: &str, token: Option<Uuid>, cancel: Option<DateTime<Utc>>) -> bool {
    token == Some(claim.token)
        && JobState::parse(state).ok() == Some(JobState::Running)
        && cancel.is_none()
}

/// Runs step `name` of the job `claim` holds, once per job across its runs (for claims
/// outside a worker; a handler calls [`JobContext::step`](crate::worker::JobContext::step)).
///
/// If the job has a stored result for `name`, it is decoded and returned, and `f` does not
/// run. Otherwise, in one transaction of tenure's kind ([`crate::transaction`]: IMMEDIATE on
/// SQLite, READ COMMITTED on the servers): `f` runs on `conn`, its result is written as
/// JSON to `tenure_steps`, and the job's row is locked and checked to be still running under
/// `claim`'s token, not asked to cancel; then it commits. So the step's result and `f`'s own
/// writes on `conn` commit together, only while the claim holds, or not at all. The value
/// returned is the result as read back from its JSON, the value every later run gets:
///
/// - `f` fails: [`StepError::Failed`], everything rolled back, nothing stored;
/// - the claim was lost (rescued, reclaimed, given back, the job finished, pruned or asked to
///   cancel): [`Error::ClaimLost`], rolled back; also for a step stored meanwhile, and
///   without running `f` if it was lost before the step began;
/// - the result is longer than [`MAX_RESULT_BYTES`] as JSON, cannot be written as JSON, or
///   does not read back from it as `T` (a NaN or an infinity is written as `null`):
///   [`Error::InvalidInput`], rolled back.
///
/// `name`: 1 to 255 bytes, no NUL ([`Error::InvalidInput`] before anything runs). Calling
/// the same name again (in this run or a later one) returns the stored result. A stored
/// result that does not decode as `T` (the step's type changed) is [`Error::InvalidInput`].
///
/// On SQLite the transaction holds the database's write lock while `f` runs: keep steps
/// short there, other writers wait for them.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tenure::diesel::{self, RunQueryDsl};
/// use tenure::jobs::{self, NewJob, StepError};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// diesel::sql_query("CREATE TABLE rows (n INTEGER)").execute(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("q", "batch", vec![]))?.id;
/// let claim = jobs::claim(&mut conn, "q", 1, Duration::from_secs(60))?.remove(0).claim();
/// let fetch = |conn: &mut tenure::AnyConnection| {
///     diesel::sql_query("INSERT INTO rows VALUES (1)").execute(conn)?;
///     Ok::<_, diesel::result::Error>(vec![1, 2, 3])
/// };
/// let rows: Vec<i32> = jobs::run_step(&mut conn, claim, "fetch", fetch).map_err(|e| e.to_string())?;
/// // Again (as a retry would): the stored result, and the closure does not run.
/// let again: Vec<i32> = jobs::run_step(&mut conn, claim, "fetch", fetch).map_err(|e| e.to_string())?;
/// assert_eq!((rows, again), (vec![1, 2, 3], vec![1, 2, 3]));
/// assert_eq!(jobs::steps(&mut conn, id)?.len(), 1);
/// # Ok(()) }
/// ```
pub fn run_step<T, E, F>(
    conn: &mut AnyConnection,
    claim: JobClaim,
    name: &str,
    f: F,
) -> std::result::Result<T, StepError<E>>
where
    T: Serialize + DeserializeOwned,
    F: FnOnce(&mut AnyConnection) -> std::result::Result<T, E>,
{
    validate::name("step name", name)?;
    // A run that lost its claim gets ClaimLost, also for a step stored meanwhile (by the run
    // that holds the job now), and its closure does not run.
    if let Some(body) = stored_for(conn, claim, name)? {
        return Ok(decode_step(name, &body)?);
    }
    let outcome = crate::transaction(conn, |conn| {
        let value = f(conn).map_err(Abort::Closure)?;
        let (value, body) = encode_read_back(name, &value)?;
        let row: Option<ClaimRow> = dispatch!(conn, c => {
            statement(c.syntax().render(LOCK_CLAIM))
                .bind::<BigInt, _>(claim.id)
                .get_result::<ClaimRow>(c)
                .optional()
        })?;
        let held = row
            .is_some_and(|row| holds(claim, &row.state, row.claim_token, row.cancel_requested_at));
        if !held {
            return Err(Abort::Tenure(Error::ClaimLost { id: claim.id }));
        }
        let inserted = dispatch!(conn, c => {
            diesel::insert_into(tenure_steps::table)
                .values((
                    tenure_steps::job_id.eq(claim.id),
                    tenure_steps::name.eq(name),
                    tenure_steps::result.eq(&body),
                    tenure_steps::created_at.eq(DatabaseNow),
                ))
                .execute(c)
        });
        match inserted {
            Ok(_) => Ok(value),
            Err(DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => {
                Err(Abort::StoredMeanwhile)
            }
            Err(e) => Err(e.into()),
        }
    });
    match outcome {
        Ok(value) => Ok(value),
        Err(Abort::Closure(e)) => Err(StepError::Failed(e)),
        Err(Abort::Tenure(e)) => Err(StepError::Tenure(e)),
        // This run stored it from another thread while `f` ran here: that one counts, this
        // one's writes were rolled back.
        Err(Abort::StoredMeanwhile) => match stored_for(conn, claim, name)? {
            Some(body) => Ok(decode_step(name, &body)?),
            None => Err(StepError::Tenure(Error::ClaimLost { id: claim.id })),
        },
        Err(Abort::KeptMeanwhile(body)) => Ok(decode_step(name, &body)?),
    }
}

/// `f` and its result's encoding in one transaction of tenure's kind, with no claim to check
/// and nothing stored: a context made for a test, which keeps its steps itself. `keep` is
/// called with the result before the commit and keeps it unless a step of that name was kept
/// meanwhile (another thread of the context), whose result it returns: then this one's writes
/// are rolled back and the kept result returned, as a worker's run does. `unkeep` undoes a
/// `keep` whose commit failed.
pub(crate) fn run_unfenced_step<T, E, F>(
    conn: &mut AnyConnection,
    name: &str,
    f: F,
    keep: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
    unkeep: impl FnOnce(),
) -> std::result::Result<T, StepError<E>>
where
    T: Serialize + DeserializeOwned,
    F: FnOnce(&mut AnyConnection) -> std::result::Result<T, E>,
{
    let mut kept = false;
    let outcome = crate::transaction(conn, |conn| {
        let value = f(conn).map_err(Abort::Closure)?;
        let (value, body) = encode_read_back(name, &value)?;
        if let Some(other) = keep(&body) {
            return Err(Abort::KeptMeanwhile(other));
        }
        kept = true;
        Ok(value)
    });
    match outcome {
        Ok(value) => Ok(value),
        Err(Abort::KeptMeanwhile(body)) => Ok(decode_step(name, &body)?),
        Err(abort) => {
            // Kept, then the commit failed: nothing of the step stands.
            if kept {
                unkeep();
            }
            Err(match abort {
                Abort::Closure(e) => StepError::Failed(e),
                Abort::Tenure(e) => StepError::Tenure(e),
                Abort::StoredMeanwhile | Abort::KeptMeanwhile(_) => {
                    StepError::Tenure(Error::invalid("step", "stored twice"))
                }
            })
        }
    }
}

/// A step's result encoded, and read back from its encoding: what the run that stores it
/// returns, so that it gets what every later run reads (JSON changes some values: `Some(())`
/// and `Some(None)` are `null`, a skipped field comes back as its default). A value that does
/// not read back at all (a NaN or an infinity, written as `null`) is refused here, before
/// anything commits, not stored to fail every retry.
fn encode_read_back<T: Serialize + DeserializeOwned>(
    name: &str,
    value: &T,
) -> Result<(T, Vec<u8>)> {
    let body = encode(value)?;
    let read: T = serde_json::from_slice(&body).map_err(|e| {
        Error::invalid(
            "step result",
            format!(
                "step {name:?}'s result does not read back from its JSON ({e}): a NaN or an \
                 infinity is written as null"
            ),
        )
    })?;
    Ok((read, body))
}

/// A step's result as stored: JSON, at most [`MAX_RESULT_BYTES`].
pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(value)
        .map_err(|e| Error::invalid("step result", format!("cannot be written as JSON: {e}")))?;
    if body.len() > MAX_RESULT_BYTES {
        return Err(Error::invalid(
            "step result",
            format!("is {} bytes, the limit is {MAX_RESULT_BYTES}", body.len()),
        ));
    }
    Ok(body)
}

/// A stored result read back as `T`.
pub(crate) fn decode_step<T: DeserializeOwned>(name: &str, body: &[u8]) -> Result<T> {
    serde_json::from_slice(body).map_err(|e| {
        Error::invalid(
            "step result",
            format!("step {name:?}'s stored result is not the JSON expected: {e}"),
        )
    })
}

/// The stored result of step `name` of `claim`'s job, if it has one, read in one statement
/// with the job's row: [`Error::ClaimLost`] if the job is no longer `claim`'s run (gone,
/// finished, claimed again, asked to cancel), whether the step is stored or not.
fn stored_for(conn: &mut AnyConnection, claim: JobClaim, name: &str) -> Result<Option<Vec<u8>>> {
    type Row = (String, Option<Uuid>, Option<DateTime<Utc>>, Option<Vec<u8>>);
    let row: Option<Row> = dispatch!(conn, c => {
        tenure_jobs::table
            .left_join(
                tenure_steps::table.on(tenure_steps::job_id
                    .eq(tenure_jobs::id)
                    .and(tenure_steps::name.eq(name))),
            )
            .filter(tenure_jobs::id.eq(claim.id))
            .select((
                tenure_jobs::state,
                tenure_jobs::claim_token,
                tenure_jobs::cancel_requested_at,
                tenure_steps::result.nullable(),
            ))
            .get_result::<Row>(c)
            .optional()
    })?;
    match row {
        Some((state, token, cancel, body)) if holds(claim, &state, token, cancel) => Ok(body),
        _ => Err(Error::ClaimLost { id: claim.id }),
    }
}

/// The completed steps of job `id`, in the order they committed; empty for a job with none,
/// or no such job.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs;
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// assert!(jobs::steps(&mut conn, 42)?.is_empty());
/// # Ok(()) }
/// ```
pub fn steps<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<JobStep>> {
    Ok(dispatch!(conn, c => {
        tenure_steps::table
            .filter(tenure_steps::job_id.eq(id))
            .order((
                tenure_steps::created_at,
                diesel::dsl::sql::<BigInt>(c.syntax().insertion_tiebreak),
            ))
            .select(JobStep::as_select())
            .load(c)
    })?)
}

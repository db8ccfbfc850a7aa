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

use super::results::MAX_RESULT_BYTES;
use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::jobs::{JobClaim, JobState};
use crate::schema::tenure_steps;
use crate::sql_types::{DatabaseNow, Token};
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
const LOCK_CLAIM: &str = "SELECT state, claim_token FROM tenure_jobs WHERE id = ?{for_update}";

#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<Token>)]
    claim_token: Option<uuid::Uuid>,
}

/// Runs step `name` of the job `claim` holds, once per job across its runs (for claims
/// outside a worker; a handler calls [`JobContext::step`](crate::worker::JobContext::step)).
///
/// If the job has a stored result for `name`, it is decoded and returned, and `f` does not
/// run. Otherwise, in one transaction of tenure's kind ([`crate::transaction`]: IMMEDIATE on
/// SQLite, READ COMMITTED on the servers): `f` runs on `conn`, its result is written as
/// JSON to `tenure_steps`, and the job's row is locked and checked to be still running under
/// `claim`'s token; then it commits. So the step's result and `f`'s own writes on `conn`
/// commit together, only while the claim holds, or not at all:
///
/// - `f` fails: [`StepError::Failed`], everything rolled back, nothing stored;
/// - the claim was lost (rescued, reclaimed, the job finished): [`Error::ClaimLost`],
///   rolled back;
/// - the result is longer than [`MAX_RESULT_BYTES`] as JSON, or cannot be written as JSON:
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
    if let Some(body) = stored(conn, claim.id, name)? {
        return Ok(decode_step(name, &body)?);
    }
    let outcome = crate::transaction(conn, |conn| {
        let value = f(conn).map_err(Abort::Closure)?;
        let body = encode(&value)?;
        let row: Option<ClaimRow> = dispatch!(conn, c => {
            statement(c.syntax().render(LOCK_CLAIM))
                .bind::<BigInt, _>(claim.id)
                .get_result::<ClaimRow>(c)
                .optional()
        })?;
        let holds = row.is_some_and(|row| {
            row.claim_token == Some(claim.token)
                && JobState::parse(&row.state).ok() == Some(JobState::Running)
        });
        if !holds {
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
        Err(Abort::StoredMeanwhile) => match stored(conn, claim.id, name)? {
            Some(body) => Ok(decode_step(name, &body)?),
            None => Err(StepError::Tenure(Error::ClaimLost { id: claim.id })),
        },
    }
}

/// `f` and its result's encoding in one transaction of tenure's kind, with no claim to check
/// and nothing stored: a context made for a test, which keeps its steps itself.
pub(crate) fn run_unfenced_step<T, E, F>(
    conn: &mut AnyConnection,
    f: F,
) -> std::result::Result<(T, Vec<u8>), StepError<E>>
where
    T: Serialize,
    F: FnOnce(&mut AnyConnection) -> std::result::Result<T, E>,
{
    let outcome = crate::transaction(conn, |conn| {
        let value = f(conn).map_err(Abort::Closure)?;
        let body = encode(&value)?;
        Ok((value, body))
    });
    outcome.map_err(|abort| match abort {
        Abort::Closure(e) => StepError::Failed(e),
        Abort::Tenure(e) => StepError::Tenure(e),
        Abort::StoredMeanwhile => StepError::Tenure(Error::invalid("step", "stored twice")),
    })
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

/// The stored result of step `name` of job `id`, if it has one.
fn stored(conn: &mut AnyConnection, id: i64, name: &str) -> Result<Option<Vec<u8>>> {
    Ok(dispatch!(conn, c => {
        tenure_steps::table
            .find((id, name))
            .select(tenure_steps::result)
            .get_result::<Vec<u8>>(c)
            .optional()
    })?)
}

/// The completed steps of job `id`, in the order they committed (by name among those of
/// one instant); empty for a job with none, or no such job.
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
            .order((tenure_steps::created_at, tenure_steps::name))
            .select(JobStep::as_select())
            .load(c)
    })?)
}

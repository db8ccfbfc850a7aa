//! Parking: by a run (the token made while the run holds its claim, the job parked when the
//! worker records the run) and at enqueue. The park row every other part reads.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Nullable};
use uuid::Uuid;

use super::answer::{Answer, apply, mark};
use super::answers;
use super::token::ParkToken;
use crate::backend::statement::statement;
use crate::backend::transaction::retrying_transaction;
use crate::backend::{Dialect, dispatch};
use crate::jobs::queue::finish::{Ending, end_locked, lock_state};
use crate::jobs::queue::model::StateRow;
use crate::jobs::{Backoff, JobClaim, JobResult, JobState, NewJob, Outcome, Retry};
use crate::schema::{tenure_jobs, tenure_parked};
use crate::sql_types::Token;
use crate::{Error, Result, TenureConnection, validate};

/// A park's row: the token's hash, the run that made it, its deadline (database clock).
const INSERT_PARK: &str = "\
    INSERT INTO tenure_parked (job_id, token_hash, claim_token, parked_at, deadline, \
        backoff_base_micros, backoff_max_micros) \
    VALUES (?, ?, ?, {now}, {now+ttl}, ?, ?)";

/// Parked: no claim to expire (the token stays, to recognise a repeated record).
const PARK_JOB: &str =
    "UPDATE tenure_jobs SET state = 'parked', claim_expires_at = NULL WHERE id = ?";

/// The error of a run that returned `JobError::parked()` without a park of its own.
const NO_PARK: &str = "the handler returned JobError::parked() without JobContext::park";

/// The error of a run whose park was closed before the job was parked (not expected: only
/// the run itself closes its park while it holds its claim).
const CLOSED: &str = "the run's park was closed before the job was parked";

/// A job's park, as its row holds it.
#[derive(Queryable, Selectable)]
#[diesel(table_name = tenure_parked)]
pub(super) struct ParkRow {
    pub token_hash: Vec<u8>,
    pub claim_token: Option<Uuid>,
    pub backoff_base_micros: i64,
    pub backoff_max_micros: i64,
    pub answer: Option<String>,
    pub value_format: Option<String>,
    pub value_body: Option<Vec<u8>>,
    pub answer_error: Option<String>,
}

impl ParkRow {
    /// The backoff of a failure's retry, as the park recorded it.
    pub fn backoff(&self) -> Backoff {
        let micros = |m: i64| Duration::from_micros(u64::try_from(m).unwrap_or(0));
        Backoff {
            base: micros(self.backoff_base_micros),
            max: micros(self.backoff_max_micros),
        }
    }

    /// The value an answer stored (a completion's result, a resume's value).
    pub fn value(&self) -> Option<JobResult> {
        match (&self.value_format, &self.value_body) {
            (Some(format), Some(body)) => Some(JobResult::from_row(format, body.clone())),
            _ => None,
        }
    }
}

/// A job's park row, read under the job's row lock (every writer holds it).
pub(super) fn load_park<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<ParkRow>> {
    Ok(dispatch!(conn, c => {
        tenure_parked::table
            .find(id)
            .select(ParkRow::as_select())
            .first(c)
            .optional()
    })?)
}

/// Writes a job's park in place of its last one.
fn write_park<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    token: &ParkToken,
    claim: Option<Uuid>,
    deadline_micros: i64,
    backoff: Backoff,
) -> Result<()> {
    let base = validate::delay_micros(backoff.base)?;
    let max = validate::delay_micros(backoff.max)?;
    let hash = token.hash();
    dispatch!(conn, c => {
        diesel::delete(tenure_parked::table.find(id)).execute(c)?;
        statement(c.syntax().render(INSERT_PARK))
            .bind::<BigInt, _>(id)
            .bind::<Binary, _>(hash.as_slice())
            .bind::<Nullable<Token>, _>(claim)
            .bind::<BigInt, _>(deadline_micros)
            .bind::<BigInt, _>(base)
            .bind::<BigInt, _>(max)
            .execute(c)
    })?;
    Ok(())
}

/// A job with a dedup key does not park: parked, it holds no key (like a blocked job), and
/// its resume could then meet a live twin of the key.
fn refuse_keyed<C: TenureConnection>(conn: &mut C, id: i64) -> Result<()> {
    let key: Option<String> = dispatch!(conn, c => {
        tenure_jobs::table.find(id).select(tenure_jobs::dedup_key).first(c)
    })?;
    match key {
        Some(_) => Err(keyed()),
        None => Ok(()),
    }
}

fn keyed() -> Error {
    Error::invalid(
        "park",
        "a job with a dedup key cannot park (parked, it would hold no key, and resuming it could meet a live twin)",
    )
}

/// The deadline as microseconds from the database's now: at most 366 days.
fn deadline_micros(deadline: Duration) -> Result<i64> {
    validate::delay_micros(deadline)
        .map_err(|_| Error::invalid("park deadline", "is longer than 366 days"))
}

/// Records a park for the run of `claim`, fenced by it: the job stays running (its handler
/// has not returned) and the token can be answered at once ([`super::ParkedOutcome::Accepted`]).
/// [`Error::ClaimLost`] if the claim is no longer the run's.
pub(crate) fn park_in_run<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
    deadline: Duration,
    backoff: Backoff,
) -> Result<ParkToken> {
    let micros = deadline_micros(deadline)?;
    let token = ParkToken::generate(claim.id)?;
    retrying_transaction(conn, |conn| {
        let held = lock_state(conn, claim.id)?.filter(|row| {
            row.claim_token == Some(claim.token)
                && row.state == JobState::Running.as_str()
                && row.cancel_requested_at.is_none()
        });
        if held.is_none() {
            return Err(Error::ClaimLost { id: claim.id });
        }
        // One park per run: a second would replace the token handed out (and an answer it
        // may have had already), leaving a token that can no longer answer its job.
        if load_park(conn, claim.id)?.is_some_and(|p| p.claim_token == Some(claim.token)) {
            return Err(Error::invalid(
                "park",
                "this run parked its job already: the token it returned is the job's",
            ));
        }
        refuse_keyed(conn, claim.id)?;
        write_park(conn, claim.id, &token, Some(claim.token), micros, backoff)
    })?;
    Ok(token)
}

/// The worker's record of a run that returned `JobError::parked()`, fenced by its claim:
/// the job is parked, or, if its token was answered while the run went on, the answer is
/// applied now (once: the answer is read and applied under the job's row lock). A job asked
/// to cancel is cancelled.
pub(crate) fn record_parked_run<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
) -> Result<Outcome> {
    let (outcome, wake) = retrying_transaction(conn, |conn| {
        let Some(row) = lock_state(conn, claim.id)? else {
            return Ok((Outcome::Lost, None));
        };
        if row.claim_token != Some(claim.token) {
            return Ok((Outcome::Lost, None));
        }
        let park = load_park(conn, claim.id)?.filter(|p| p.claim_token == Some(claim.token));
        match JobState::parse(&row.state)? {
            JobState::Running if row.cancel_requested_at.is_some() => {
                let released = end_locked(conn, &row, Ending::Cancel)?;
                Ok((Outcome::Cancelled, Some(released)))
            }
            JobState::Running => match park {
                None => {
                    let released = end_locked(
                        conn,
                        &row,
                        Ending::Fail {
                            error: NO_PARK,
                            retry: Retry::Backoff(Backoff::default()),
                        },
                    )?;
                    Ok((Outcome::Done, Some(released)))
                }
                Some(park) => {
                    let released = park_run(conn, &row, &park)?;
                    Ok((Outcome::Done, released))
                }
            },
            JobState::Cancelled => Ok((Outcome::Cancelled, None)),
            // This record again after a lost reply, or after a rescue parked the run: parked
            // then, maybe answered since.
            _ if park.is_some() => Ok((Outcome::AlreadyDone, None)),
            _ => Ok((Outcome::Lost, None)),
        }
    })?;
    if let Some(queues) = wake {
        crate::wake::wake(queues.iter().map(String::as_str));
        crate::jobs::queue::wait::ended();
    }
    Ok(outcome)
}

/// Parks the job of a run that parked (its row locked, running under the park's claim, no
/// cancel asked): parked, or its pending answer applied and kept under its own name. Returns
/// the queues to wake if the job left its park (an answer applied).
fn park_run<C: TenureConnection>(
    conn: &mut C,
    row: &StateRow,
    park: &ParkRow,
) -> Result<Option<Vec<String>>> {
    let pending = park.answer.as_deref().map(answers::of_pending);
    match pending {
        None => {
            dispatch!(conn, c => {
                statement(PARK_JOB).bind::<BigInt, _>(row.id).execute(c)
            })?;
            Ok(None)
        }
        Some(Some(name)) => {
            let value = park.value();
            let error = park.answer_error.as_deref();
            let answer = match name {
                answers::COMPLETE => Answer::Complete(value.as_ref()),
                answers::RESUME => Answer::Resume(value.as_ref()),
                _ => Answer::Fail(error.unwrap_or("failed")),
            };
            let released = apply(conn, row, park, &answer)?;
            mark(conn, row.id, name, value.as_ref(), error)?;
            Ok(Some(released))
        }
        // Closed while its run held the claim (nothing closes it then): the run failed.
        Some(None) => {
            let released = end_locked(
                conn,
                row,
                Ending::Fail {
                    error: CLOSED,
                    retry: Retry::Backoff(park.backoff()),
                },
            )?;
            Ok(Some(released))
        }
    }
}

/// The rescue's part (in its transaction, the rows of `ids` locked, running, found stalled):
/// the runs among them that parked their job (a token was handed out) and were not asked to
/// cancel are parked instead of requeued, a pending answer applied. Returns those jobs and
/// the queues to wake after the commit; the rescue requeues the others.
pub(crate) fn park_rescued_runs<C: TenureConnection>(
    conn: &mut C,
    ids: &[i64],
) -> Result<(Vec<i64>, Vec<String>)> {
    let parks: Vec<(i64, Option<Uuid>)> = dispatch!(conn, c => {
        tenure_parked::table
            .filter(tenure_parked::job_id.eq_any(ids))
            .filter(tenure_parked::claim_token.is_not_null())
            .select((tenure_parked::job_id, tenure_parked::claim_token))
            .load(c)
    })?;
    let mut parked = Vec::new();
    let mut wake = Vec::new();
    for (id, claim) in parks {
        let Some(row) = lock_state(conn, id)? else {
            continue;
        };
        let running = row.state == JobState::Running.as_str();
        if !running || row.claim_token != claim || row.cancel_requested_at.is_some() {
            continue;
        }
        let Some(park) = load_park(conn, id)? else {
            continue;
        };
        wake.extend(park_run(conn, &row, &park)?.unwrap_or_default());
        parked.push(id);
    }
    Ok((parked, wake))
}

/// A job enqueued parked ([`enqueue_parked`]): its id and the token that answers it.
#[derive(Debug)]
pub struct EnqueuedParked {
    /// The job's id.
    pub id: i64,
    /// Its token (see [`ParkToken::expose_secret`]).
    pub token: ParkToken,
}

/// Enqueues a job parked: it runs only once its token resumes it
/// ([`resume_parked`](super::resume_parked)), or it ends by its token
/// ([`complete_parked`](super::complete_parked), [`fail_parked`](super::fail_parked)) or its
/// deadline (database now + `deadline`, at most 366 days: it then fails, retried with the
/// default [`Backoff`] while attempts remain). For an approval that gates a job. Joins the
/// caller's transaction. A job with a dedup key or dependencies is
/// [`Error::InvalidInput`], before any statement.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobState, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let parked = jobs::enqueue_parked(&mut conn, &NewJob::new("pay", "refund", vec![]), Duration::from_secs(3600))?;
/// assert_eq!(jobs::get(&mut conn, parked.id)?.unwrap().state, JobState::Parked);
/// // ... the approver's click, carrying parked.token.expose_secret() ...
/// jobs::resume_parked(&mut conn, &parked.token, None)?;
/// assert_eq!(jobs::get(&mut conn, parked.id)?.unwrap().state, JobState::Waiting);
/// # Ok(()) }
/// ```
pub fn enqueue_parked<C: TenureConnection>(
    conn: &mut C,
    job: &NewJob,
    deadline: Duration,
) -> Result<EnqueuedParked> {
    job.validate()?;
    let micros = deadline_micros(deadline)?;
    if job.dedup_key.is_some() {
        return Err(keyed());
    }
    if !job.dependencies.is_empty() {
        return Err(Error::invalid(
            "park",
            "a job with dependencies cannot be enqueued parked",
        ));
    }
    if job.sequence.is_some() {
        return Err(Error::invalid(
            "park",
            "a job of a sequence cannot be enqueued parked (it may have to wait for the one before it)",
        ));
    }
    retrying_transaction(conn, |conn| {
        let id = crate::jobs::enqueue(conn, job)?.id;
        let token = ParkToken::generate(id)?;
        dispatch!(conn, c => statement(PARK_JOB).bind::<BigInt, _>(id).execute(c))?;
        write_park(conn, id, &token, None, micros, Backoff::default())?;
        Ok(EnqueuedParked { id, token })
    })
}

//! Answering a park with its token: complete, fail or resume the job, once.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Nullable, Text};

use super::answers;
use super::park::{ParkRow, load_park};
use super::token::ParkToken;
use super::{ParkRefusal, ParkedOutcome};
use crate::backend::statement::statement;
use crate::backend::transaction::{in_transaction, retrying_transaction};
use crate::backend::{Dialect, dispatch};
use crate::jobs::queue::errors::{storable, truncate};
use crate::jobs::queue::finish::{Ending, end_locked, lock_state};
use crate::jobs::queue::model::StateRow;
use crate::jobs::{JobResult, JobState, MAX_ERROR_BYTES, Retry};
use crate::schema::tenure_jobs;
use crate::{Error, Result, TenureConnection};

/// Resumed: waiting, due at once, the run that parked given back its attempt (a resume
/// continues the run, it is no retry). A job parked at enqueue has used none.
const RESUME_JOB: &str = "\
    UPDATE tenure_jobs SET state = 'waiting', due_at = {now}, claim_expires_at = NULL, \
        attempt = CASE WHEN attempt > 0 THEN attempt - 1 ELSE 0 END \
    WHERE id = ?";

/// The token's use, kept: a second use is refused as [`ParkRefusal::Used`].
const MARK_ANSWERED: &str = "\
    UPDATE tenure_parked SET answer = ?, value_format = ?, value_body = ?, answer_error = ?, \
        answered_at = {now} \
    WHERE job_id = ?";

/// What a token's holder says.
pub(super) enum Answer<'a> {
    Complete(Option<&'a JobResult>),
    Fail(&'a str),
    Resume(Option<&'a JobResult>),
}

impl Answer<'_> {
    fn name(&self) -> &'static str {
        match self {
            Answer::Complete(_) => answers::COMPLETE,
            Answer::Fail(_) => answers::FAIL,
            Answer::Resume(_) => answers::RESUME,
        }
    }
}

/// Applies an answer to a job whose row the caller's transaction locked; returns the queues
/// to wake once it commits (released dependents', a resumed job's).
pub(super) fn apply<C: TenureConnection>(
    conn: &mut C,
    row: &StateRow,
    park: &ParkRow,
    answer: &Answer<'_>,
) -> Result<Vec<String>> {
    match answer {
        Answer::Complete(result) => end_locked(conn, row, Ending::Complete(*result)),
        Answer::Fail(error) => end_locked(
            conn,
            row,
            Ending::Fail {
                error,
                retry: Retry::Backoff(park.backoff()),
            },
        ),
        Answer::Resume(_) => {
            let queue: String = dispatch!(conn, c => {
                statement(c.syntax().render(RESUME_JOB)).bind::<BigInt, _>(row.id).execute(c)?;
                tenure_jobs::table.find(row.id).select(tenure_jobs::queue).first(c)
            })?;
            Ok(vec![queue])
        }
    }
}

/// Marks a park's token used (or closed, `answer` being [`answers::EXPIRED`] or
/// [`answers::DROPPED`]), keeping the answer's value or error.
pub(super) fn mark<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    answer: &str,
    value: Option<&JobResult>,
    error: Option<&str>,
) -> Result<()> {
    dispatch!(conn, c => {
        statement(c.syntax().render(MARK_ANSWERED))
            .bind::<Text, _>(answer)
            .bind::<Nullable<Text>, _>(value.map(JobResult::format))
            .bind::<Nullable<Binary>, _>(value.map(JobResult::as_bytes))
            .bind::<Nullable<Text>, _>(error)
            .bind::<BigInt, _>(id)
            .execute(c)
    })?;
    Ok(())
}

fn refused(why: ParkRefusal) -> Error {
    Error::ParkTokenRefused(why)
}

/// Answers the park `token` is for, in one transaction (the caller's, if one is open): the
/// job's row locked first, then the token's hash compared (in constant time), then the
/// answer applied, or kept for the run that has not returned yet.
fn answer<C: TenureConnection>(
    conn: &mut C,
    token: &ParkToken,
    answer: Answer<'_>,
) -> Result<ParkedOutcome> {
    let id = token.job_id();
    let inside = in_transaction(conn);
    let (outcome, wake) = retrying_transaction(conn, |conn| {
        let row = lock_state(conn, id)?.ok_or(refused(ParkRefusal::Invalid))?;
        let park = load_park(conn, id)?.ok_or(refused(ParkRefusal::Invalid))?;
        if !token.matches(&park.token_hash) {
            return Err(refused(ParkRefusal::Invalid));
        }
        match park.answer.as_deref() {
            Some(answers::EXPIRED | answers::DROPPED) => {
                return Err(refused(ParkRefusal::NotParked));
            }
            Some(_) => return Err(refused(ParkRefusal::Used)),
            None => {}
        }
        // Past its deadline by the database's clock it is no longer parked for an answer,
        // whether or not a worker's maintenance has failed it yet.
        if super::expire::past_deadline(conn, id)? {
            return Err(refused(ParkRefusal::NotParked));
        }
        let (value, error) = match &answer {
            Answer::Complete(value) | Answer::Resume(value) => (*value, None),
            Answer::Fail(error) => (None, Some(*error)),
        };
        let same_run = park.claim_token == row.claim_token;
        match JobState::parse(&row.state)? {
            JobState::Parked if same_run => {
                let queues = apply(conn, &row, &park, &answer)?;
                mark(conn, id, answer.name(), value, error)?;
                Ok((ParkedOutcome::Applied, queues))
            }
            // The run that parked has not returned: kept for the worker's record of it.
            JobState::Running
                if same_run && park.claim_token.is_some() && row.cancel_requested_at.is_none() =>
            {
                mark(conn, id, answers::pending(answer.name()), value, error)?;
                Ok((ParkedOutcome::Accepted, Vec::new()))
            }
            _ => Err(refused(ParkRefusal::NotParked)),
        }
    })?;
    if outcome == ParkedOutcome::Applied {
        // Inside a caller's transaction other processes' workers find it at their next poll.
        if !inside {
            crate::wake::notify_committed(conn, wake.iter().map(String::as_str));
        }
        crate::wake::wake(wake.iter().map(String::as_str));
        crate::jobs::queue::wait::ended();
    }
    Ok(outcome)
}

/// Completes the parked job `token` is for, with its result if given (stored with the
/// completion; its dependents released in the same transaction, as by any completion).
/// A token answers its job once: a second use, a wrong token, or a job no longer parked is
/// [`Error::ParkTokenRefused`] (with [`ParkRefusal`]) and changes nothing. Joins the
/// caller's transaction.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobResult, JobState, NewJob, ParkRefusal, ParkedOutcome};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let parked = jobs::enqueue_parked(&mut conn, &NewJob::new("pay", "charge", vec![]), Duration::from_secs(600))?;
/// let outcome = jobs::complete_parked(&mut conn, &parked.token, Some(&JobResult::json(&"paid")?))?;
/// assert_eq!(outcome, ParkedOutcome::Applied);
/// assert_eq!(jobs::get(&mut conn, parked.id)?.unwrap().state, JobState::Completed);
/// let again = jobs::complete_parked(&mut conn, &parked.token, None).unwrap_err();
/// assert!(matches!(again, tenure::Error::ParkTokenRefused(ParkRefusal::Used)));
/// # Ok(()) }
/// ```
pub fn complete_parked<C: TenureConnection>(
    conn: &mut C,
    token: &ParkToken,
    result: Option<&JobResult>,
) -> Result<ParkedOutcome> {
    answer(conn, token, Answer::Complete(result))
}

/// Fails the parked job `token` is for, as a failed run: retried after the backoff of its
/// kind (recorded when it parked) while attempts remain, else dead; the error (cut to
/// [`MAX_ERROR_BYTES`]) kept in its history. Refused as [`complete_parked`] is.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # use std::time::Duration;
/// # use tenure::jobs::{self, JobState, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// let parked = jobs::enqueue_parked(&mut conn, &NewJob::new("pay", "charge", vec![]).max_attempts(1), Duration::from_secs(600))?;
/// jobs::fail_parked(&mut conn, &parked.token, "card declined")?;
/// assert_eq!(jobs::get(&mut conn, parked.id)?.unwrap().state, JobState::Waiting); // a retry
/// # Ok(()) }
/// ```
pub fn fail_parked<C: TenureConnection>(
    conn: &mut C,
    token: &ParkToken,
    error: &str,
) -> Result<ParkedOutcome> {
    let error = storable(error);
    answer(conn, token, Answer::Fail(truncate(&error, MAX_ERROR_BYTES)))
}

/// Resumes the parked job `token` is for: waiting again, due at once, its next run reading
/// `value` with [`JobContext::resume_value`](crate::worker::JobContext::resume_value). The
/// run that parked gives back its attempt: the resumed run continues it. Refused as
/// [`complete_parked`] is.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # use std::time::Duration;
/// # use tenure::jobs::{self, JobResult, JobState, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// let parked = jobs::enqueue_parked(&mut conn, &NewJob::new("docs", "publish", vec![]), Duration::from_secs(600))?;
/// jobs::resume_parked(&mut conn, &parked.token, Some(&JobResult::json(&"approved by ada")?))?;
/// assert_eq!(jobs::get(&mut conn, parked.id)?.unwrap().state, JobState::Waiting);
/// # Ok(()) }
/// ```
pub fn resume_parked<C: TenureConnection>(
    conn: &mut C,
    token: &ParkToken,
    value: Option<&JobResult>,
) -> Result<ParkedOutcome> {
    answer(conn, token, Answer::Resume(value))
}

/// The value the last resume of job `id` gave, if its last park was resumed with one.
pub(crate) fn resume_value<C: TenureConnection>(
    conn: &mut C,
    id: i64,
) -> Result<Option<JobResult>> {
    let park = load_park(conn, id)?;
    Ok(park
        .filter(|p| p.answer.as_deref() == Some(answers::RESUME))
        .and_then(|p| p.value()))
}

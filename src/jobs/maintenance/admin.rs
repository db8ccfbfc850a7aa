//! An operator's calls on single jobs and on the dead: cancel a job (or ask a running one to
//! stop), and run dead jobs again (one, or every dead job of a kind).

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};

use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::jobs::JobState;
use crate::sql_types::DatabaseNow;
use crate::{Error, Result, TenureConnection, validate};

/// A waiting (or blocked, or parked) job is cancelled at once. A running job is asked to: it stays running under its
/// claim (its handler is still running, and holds its limit key) until the worker, told at
/// its next heartbeat, records the run's end, which cancels it (or its claim lapses and the
/// rescue does). MySQL assigns left to right, reading the values assigned before: `state`
/// comes last, so every CASE reads the row's state as it was.
const CANCEL: &str = "\
    UPDATE tenure_jobs SET \
        finished_at = CASE WHEN state IN ('waiting', 'blocked', 'parked') THEN {now} ELSE finished_at END, \
        cancel_requested_at = CASE WHEN state = 'running' THEN {now} \
            ELSE cancel_requested_at END, \
        state = CASE WHEN state IN ('waiting', 'blocked', 'parked') THEN 'cancelled' ELSE state END \
    WHERE id = ? AND (state IN ('waiting', 'blocked', 'parked') \
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

/// Cancels a waiting job, or asks a running one to cancel; returns whether it did (false:
/// finished, gone, or asked already). A running job stays running (and keeps its limit
/// key) until its run ends: the worker learns at its next heartbeat
/// ([`crate::jobs::Outcome::Cancelled`]), raises the handler's `should_stop`, and when the handler
/// returns the job is cancelled, whatever the run's result; if the worker is gone, the
/// rescue of its lapsed claim cancels it. Joins the caller's transaction if there is one.
///
/// A blocked or parked job is cancelled at once too (a parked job's token is refused after:
/// [`crate::jobs::ParkRefusal::NotParked`]). The jobs that depend on a cancelled job follow
/// their [`crate::jobs::RunWhen`] in the same transaction.
pub fn cancel<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    let (changed, released) = crate::backend::transaction::retrying_transaction(conn, |conn| {
        if !cancel_locked(conn, id)? {
            return Ok::<_, Error>((false, Vec::new()));
        }
        let now: CancelledState = dispatch!(conn, c => {
            statement(CANCELLED_STATE).bind::<BigInt, _>(id).get_result::<CancelledState>(c)
        })?;
        if now.state == "cancelled" {
            crate::jobs::workflows::sequence_edges::splice_out_of_sequence(conn, id)?;
        }
        let released = if now.state == "cancelled" && now.n != 0 {
            crate::jobs::workflows::dependencies::settle(conn, vec![(id, JobState::Cancelled)])?
        } else {
            Vec::new()
        };
        Ok((true, released))
    })?;
    crate::wake::wake(released.iter().map(String::as_str));
    if changed {
        crate::jobs::queue::wait::ended();
    }
    Ok(changed)
}

/// The cancel statement alone (no settling of dependents): whether it changed the job.
pub(crate) fn cancel_locked<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    let changed = dispatch!(conn, c => {
        statement(c.syntax().render(CANCEL)).bind::<BigInt, _>(id).execute(c)
    })?;
    Ok(changed == 1)
}

/// Makes a dead job wait again, due at once, with its attempts counted from zero. Returns
/// whether it was dead. Refused ([`Error::InvalidInput`]) if a live job of its queue has the
/// same dedup key.
///
/// Jobs still blocked that counted its death as finished ([`crate::jobs::RunWhen::AllFinished`])
/// wait for it again; those its death already cancelled or released stay so.
///
/// Its completed steps ([`crate::worker::JobContext::step`]) are kept: the revived job
/// resumes after the last of them, as a retry does.
pub fn retry_dead<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    use crate::schema::tenure_jobs;
    crate::backend::transaction::retrying_transaction(conn, |conn| {
        let changed = dispatch!(conn, c => {
            diesel::update(tenure_jobs::table.find(id).filter(tenure_jobs::state.eq(JobState::Dead)))
                .set(retried())
                .execute(c)
        })
        .map_err(dedup_conflict)?;
        if changed == 1 {
            crate::jobs::workflows::dependencies::rearm(conn, &[id])?;
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
    crate::backend::transaction::retrying_transaction(conn, |conn| {
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
        crate::jobs::workflows::dependencies::rearm(conn, &with_dependents)?;
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

/// The state of a job, under its row's lock.
const LOCKED_STATE: &str =
    "SELECT state, dependents AS n FROM tenure_jobs WHERE id = ?{for_update}";

/// Lets the rest of a held sequence go on past its dead or cancelled job `id`
/// ([`crate::jobs::SequenceFailure::Hold`]): the job enqueued after it in its sequence runs
/// as if `id` had completed. Returns how many jobs it released: 0 if `id` is not dead or
/// cancelled, holds no job back, or does not exist. The other way on is
/// [`retry_dead`]: the dead job runs again, and the rest follow once it completes. A job let
/// go this way and retried afterwards runs outside its sequence's order (the rest did not
/// wait for it).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobState, NewJob, Retry};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let first = jobs::enqueue(&mut conn, &NewJob::new("sync", "a", vec![]).sequence("k"))?.id;
/// let second = jobs::enqueue(&mut conn, &NewJob::new("sync", "b", vec![]).sequence("k"))?.id;
/// let claimed = jobs::claim(&mut conn, "sync", 1, Duration::from_secs(60))?;
/// jobs::fail(&mut conn, claimed[0].claim(), "broken", Retry::Never)?;
/// assert_eq!(jobs::get(&mut conn, second)?.unwrap().state, JobState::Blocked);
/// assert_eq!(jobs::skip_in_sequence(&mut conn, first)?, 1);
/// assert_eq!(jobs::get(&mut conn, second)?.unwrap().state, JobState::Waiting);
/// # Ok(()) }
/// ```
pub fn skip_in_sequence<C: TenureConnection>(conn: &mut C, id: i64) -> Result<usize> {
    let released = crate::backend::transaction::retrying_transaction(conn, |conn| {
        let state = dispatch!(conn, c => {
            statement(c.syntax().render(LOCKED_STATE))
                .bind::<BigInt, _>(id)
                .get_result::<CancelledState>(c)
                .optional()
        })?;
        match state {
            Some(s) if (s.state == "dead" || s.state == "cancelled") && s.n > 0 => {
                crate::jobs::workflows::sequence_edges::let_held_go(conn, id)
            }
            _ => Ok(Vec::new()),
        }
    })?;
    crate::wake::wake(released.iter().map(String::as_str));
    Ok(released.len())
}

//! Finishing claims: complete, fail, renew, give back and snooze, each fenced by its claim
//! token.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};

use super::errors::{record_error, storable, truncate};
use super::model::StateRow;
use super::{JobClaim, JobState, MAX_BATCH, MAX_ERROR_BYTES, MAX_FREE_SNOOZES, Outcome, Retry};
use crate::backend::statement::statement;
use crate::backend::transaction::retrying_transaction;
use crate::backend::{Dialect, dispatch};
use crate::jobs::workflows::dependencies;
use crate::jobs::workflows::results::{self, JobResult};
use crate::sql_types::Instant;
use crate::{Error, Result, TenureConnection, validate};

/// Finishing calls lock the rows they are about, then decide per job.
const LOCK_STATES: &str = "\
    SELECT id, state, claim_token, attempt, max_attempts, snoozes, cancel_requested_at, \
        dependents \
    FROM {jobs} WHERE id IN {ids}{for_update}";

/// A run of a job asked to cancel ends: the job is cancelled (not completed, failed or given
/// back), and its limit key is free.
const FINISH_CANCELLED: &str = "\
    UPDATE tenure_jobs SET state = 'cancelled', finished_at = {now}, claim_expires_at = NULL \
    WHERE id IN {ids}{in_transaction}";

/// Like the claim's mark, a completion changes its rows only inside its transaction
/// (`{in_transaction}`, MySQL): a Galera node may roll the transaction back between two
/// statements without telling the next one, which then runs in autocommit; a completion
/// committed so, with its dependents' counts rolled back, left a dependent blocked for good.
/// A write that changed fewer rows than it locked says the transaction is gone.
const COMPLETE: &str = "\
    UPDATE {jobs} SET state = 'completed', finished_at = {now}, claim_expires_at = NULL \
    WHERE id IN {ids}{in_transaction}";

const RENEW: &str = "UPDATE {jobs} SET claim_expires_at = {now+ttl} WHERE id IN {ids}";

/// Give back: due again at once, and the run does not count.
const GIVE_BACK: &str = "\
    UPDATE {jobs} SET state = 'waiting', attempt = attempt - 1, due_at = {now}, \
        claim_expires_at = NULL \
    WHERE id IN {ids}";

/// Snooze, within the free snoozes: due again at now + the delay, and the run does not count.
const SNOOZE_FREE: &str = "\
    UPDATE tenure_jobs SET state = 'waiting', attempt = attempt - 1, snoozes = snoozes + 1, \
        due_at = {now+ttl}, claim_expires_at = NULL \
    WHERE id IN {ids}";

/// Snooze past the free snoozes, attempts left: due again at now + the delay; the run counts.
const SNOOZE_PAID: &str = "\
    UPDATE tenure_jobs SET state = 'waiting', snoozes = snoozes + 1, due_at = {now+ttl}, \
        claim_expires_at = NULL \
    WHERE id IN {ids}";

/// Snooze past the free snoozes by a job out of attempts: dead.
const SNOOZE_DEAD: &str = "\
    UPDATE tenure_jobs SET state = 'dead', snoozes = snoozes + 1, finished_at = {now}, \
        last_error = ?, claim_expires_at = NULL \
    WHERE id IN {ids}";

const FAIL_RETRY: &str = "\
    UPDATE {jobs} SET state = 'waiting', due_at = COALESCE(?, {now+ttl}), last_error = ?, \
        claim_expires_at = NULL \
    WHERE id = ?";

const FAIL_DEAD: &str = "\
    UPDATE {jobs} SET state = 'dead', finished_at = {now}, last_error = ?, \
        claim_expires_at = NULL \
    WHERE id = ?";

/// What a finishing call does to the jobs it may act on.
enum Finish<'a> {
    /// With the results of some of the jobs.
    Complete(&'a [(i64, &'a JobResult)]),
    Renew(i64),
    GiveBack,
    /// Due again after this many microseconds.
    Snooze(i64),
    Fail {
        error: &'a str,
        retry: Retry,
    },
}

impl Finish<'_> {
    /// The state this call leaves a job in with the same token, to recognise a repeat.
    fn already_done(&self, state: JobState) -> bool {
        match self {
            Finish::Complete(_) => state == JobState::Completed,
            Finish::GiveBack => state == JobState::Waiting,
            Finish::Fail { .. } | Finish::Snooze(_) => {
                matches!(state, JobState::Waiting | JobState::Dead)
            }
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
/// Done ones, in one transaction: the caller's (in a savepoint) or one of tenure's kind.
fn finish<C: TenureConnection>(
    conn: &mut C,
    claims: &[JobClaim],
    finish: Finish<'_>,
) -> Result<Vec<Outcome>> {
    finish_noting(conn, claims, finish, &mut Vec::new())
}

/// [`finish`], also noting in `died` the jobs a snooze left dead (now, or by the call this
/// one repeats), with the error it recorded.
fn finish_noting<C: TenureConnection>(
    conn: &mut C,
    claims: &[JobClaim],
    finish: Finish<'_>,
    died: &mut Vec<(i64, String)>,
) -> Result<Vec<Outcome>> {
    check_claims(claims)?;
    let released = retrying_transaction(conn, |conn| {
        died.clear();
        // Each slot's claims locked through the slot's partition (the token names it); a
        // claim not found there (a token from before the slots, or a wrong one) through the
        // table itself.
        let syntax = dispatch!(any conn, c => c.syntax());
        let mut by_slot: Vec<(Option<i64>, Vec<i64>)> = Vec::new();
        for claim in claims {
            let slot = syntax.token_slot(&claim.token);
            match by_slot.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, group)) => group.push(claim.id),
                None => by_slot.push((slot, vec![claim.id])),
            }
        }
        let mut states: Vec<StateRow> = Vec::new();
        let mut slot_of: HashMap<i64, Option<i64>> = HashMap::new();
        for (slot, ids) in &by_slot {
            let found = dispatch!(conn, c => {
                statement(syntax.render_with(LOCK_STATES, &syntax.slot_jobs(*slot)))
                    .bind_ids(ids.iter().copied())
                    .load::<StateRow>(c)
            })?;
            let mut missing: HashSet<i64> = ids.iter().copied().collect();
            for row in &found {
                missing.remove(&row.id);
                slot_of.insert(row.id, *slot);
            }
            states.extend(found);
            if slot.is_some() && !missing.is_empty() {
                let found = dispatch!(conn, c => {
                    statement(syntax.render_with(LOCK_STATES, &syntax.slot_jobs(None)))
                        .bind_ids(missing.iter().copied())
                        .load::<StateRow>(c)
                })?;
                for row in &found {
                    slot_of.insert(row.id, None);
                }
                states.extend(found);
            }
        }
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
                        if matches!(finish, Finish::Snooze(_)) && state == JobState::Dead {
                            died.push((row.id, out_of_attempts(i64::from(row.snoozes))));
                        }
                        Outcome::AlreadyDone
                    } else {
                        Outcome::Lost
                    }
                }
                _ => Outcome::Lost,
            };
            outcomes.push(outcome);
        }
        // Jobs this call finishes that others depend on: their dependents are settled in
        // this transaction.
        let mut settled: Vec<(i64, JobState)> = Vec::new();
        if !apply.is_empty() {
            apply_finish(conn, &apply, &slot_of, &finish, died, &mut settled)?;
        }
        if !cancel.is_empty() {
            let ids = cancel.iter().map(|row| row.id);
            let changed = dispatch!(conn, c => {
                statement(c.syntax().render(FINISH_CANCELLED)).bind_ids(ids.clone()).execute(c)
            })?;
            if changed != distinct(ids) {
                return Err(Error::RolledBackUnderUs {
                    operation: "finishing cancelled runs",
                });
            }
            settled.extend(
                cancel
                    .iter()
                    .filter(|row| row.dependents != 0)
                    .map(|row| (row.id, JobState::Cancelled)),
            );
        }
        let released = if settled.is_empty() {
            Vec::new()
        } else {
            dependencies::settle(conn, settled)?
        };
        Ok::<_, Error>((outcomes, released))
    })?;
    let (outcomes, released) = released;
    crate::wake::wake(released.iter().map(String::as_str));
    if !matches!(finish, Finish::Renew(_) | Finish::GiveBack) {
        super::wait::ended();
    }
    Ok(outcomes)
}

fn apply_finish<C: TenureConnection>(
    conn: &mut C,
    rows: &[&StateRow],
    slot_of: &HashMap<i64, Option<i64>>,
    finish: &Finish<'_>,
    died: &mut Vec<(i64, String)>,
    settled: &mut Vec<(i64, JobState)>,
) -> Result<()> {
    let slot = |id: i64| slot_of.get(&id).copied().flatten();
    let mut by_slot: Vec<(Option<i64>, Vec<i64>)> = Vec::new();
    for row in rows {
        match by_slot.iter_mut().find(|(s, _)| *s == slot(row.id)) {
            Some((_, group)) => group.push(row.id),
            None => by_slot.push((slot(row.id), vec![row.id])),
        }
    }
    let batch_update = match finish {
        Finish::Complete(_) => Some((COMPLETE, None)),
        Finish::GiveBack => Some((GIVE_BACK, None)),
        Finish::Renew(micros) => Some((RENEW, Some(*micros))),
        Finish::Fail { .. } | Finish::Snooze(_) => None,
    };
    match (batch_update, finish) {
        (Some((template, micros)), _) => {
            let mut changed = 0;
            for (slot, ids) in &by_slot {
                let ids = ids.iter().copied();
                changed += dispatch!(conn, c => {
                    let syntax = c.syntax();
                    let sql = syntax.render_with(template, &syntax.slot_jobs(*slot));
                    match micros {
                        Some(micros) => statement(sql).bind::<BigInt, _>(micros).bind_ids(ids).execute(c),
                        None => statement(sql).bind_ids(ids).execute(c),
                    }
                })?;
            }
            if matches!(finish, Finish::Complete(_))
                && changed != distinct(rows.iter().map(|row| row.id))
            {
                return Err(Error::RolledBackUnderUs {
                    operation: "completing jobs",
                });
            }
        }
        (None, Finish::Complete(_) | Finish::GiveBack | Finish::Renew(_)) => {}
        (None, Finish::Snooze(micros)) => {
            for row in rows {
                if let Some(error) = apply_snooze(conn, row, *micros)? {
                    died.push((row.id, error));
                    if row.dependents != 0 {
                        settled.push((row.id, JobState::Dead));
                    }
                }
            }
        }
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
                    let parts = syntax.slot_jobs(slot(row.id));
                    match retry_at {
                        Some((at, micros)) => statement(syntax.render_with(FAIL_RETRY, &parts))
                            .bind::<Nullable<Instant>, _>(at)
                            .bind::<BigInt, _>(micros)
                            .bind::<Text, _>(error)
                            .bind::<BigInt, _>(row.id)
                            .execute(c),
                        None => statement(syntax.render_with(FAIL_DEAD, &parts))
                            .bind::<Text, _>(error)
                            .bind::<BigInt, _>(row.id)
                            .execute(c),
                    }
                })?;
                record_error(conn, row.id, Some(row.attempt), error)?;
                if retry_at.is_none() && row.dependents != 0 {
                    settled.push((row.id, JobState::Dead));
                }
            }
        }
    }
    if let Finish::Complete(results) = finish {
        let done: HashSet<i64> = rows.iter().map(|row| row.id).collect();
        let kept: Vec<(i64, &JobResult)> = results
            .iter()
            .filter(|(id, _)| done.contains(id))
            .copied()
            .collect();
        if !kept.is_empty() {
            results::store(conn, &kept)?;
        }
        settled.extend(
            rows.iter()
                .filter(|row| row.dependents != 0)
                .map(|row| (row.id, JobState::Completed)),
        );
    }
    Ok(())
}

/// How a job that holds no claim (a parked one) ends, as a run of it would have.
pub(crate) enum Ending<'a> {
    /// Completed, with its result if given.
    Complete(Option<&'a JobResult>),
    /// Failed: retried (attempts permitting) or dead, the error kept in its history.
    Fail { error: &'a str, retry: Retry },
    /// Cancelled (a run that parked, asked to cancel meanwhile).
    Cancel,
}

/// Locks one job's row (as finishing calls do) and reads it; `None`: no such job.
pub(crate) fn lock_state<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<StateRow>> {
    let mut rows: Vec<StateRow> = dispatch!(conn, c => {
        statement(c.syntax().render(LOCK_STATES)).bind_ids([id]).load::<StateRow>(c)
    })?;
    Ok(rows.pop())
}

/// Ends a job whose row the caller's transaction locked ([`lock_state`]) through the same
/// statements a run's end uses (results stored, errors kept, dependents settled in this
/// transaction). Returns the queues settling released jobs of, to wake after the commit.
pub(crate) fn end_locked<C: TenureConnection>(
    conn: &mut C,
    row: &StateRow,
    ending: Ending<'_>,
) -> Result<Vec<String>> {
    let mut settled: Vec<(i64, JobState)> = Vec::new();
    let kept;
    let finish = match ending {
        Ending::Complete(result) => {
            kept = result.map(|r| (row.id, r));
            Finish::Complete(kept.as_slice())
        }
        Ending::Fail { error, retry } => {
            retry.check()?;
            Finish::Fail { error, retry }
        }
        Ending::Cancel => {
            dispatch!(conn, c => {
                statement(c.syntax().render(FINISH_CANCELLED)).bind_ids([row.id]).execute(c)
            })?;
            if row.dependents != 0 {
                settled.push((row.id, JobState::Cancelled));
            }
            return dependencies::settle(conn, settled);
        }
    };
    apply_finish(
        conn,
        &[row],
        &HashMap::new(),
        &finish,
        &mut Vec::new(),
        &mut settled,
    )?;
    if settled.is_empty() {
        return Ok(Vec::new());
    }
    dependencies::settle(conn, settled)
}

/// Snoozes one claimed job: free (the attempt given back) for its first
/// [`MAX_FREE_SNOOZES`] snoozes, then the run counts, and a job out of attempts is dead.
/// Returns the error it recorded if it is dead.
fn apply_snooze<C: TenureConnection>(
    conn: &mut C,
    row: &StateRow,
    micros: i64,
) -> Result<Option<String>> {
    let snoozes = i64::from(row.snoozes) + 1;
    if row.snoozes < MAX_FREE_SNOOZES as i32 || row.attempt < row.max_attempts {
        let template = if row.snoozes < MAX_FREE_SNOOZES as i32 {
            SNOOZE_FREE
        } else {
            SNOOZE_PAID
        };
        dispatch!(conn, c => {
            statement(c.syntax().render(template))
                .bind::<BigInt, _>(micros)
                .bind_ids([row.id])
                .execute(c)
        })?;
        return Ok(None);
    }
    let error = out_of_attempts(snoozes);
    dispatch!(conn, c => {
        statement(c.syntax().render(SNOOZE_DEAD))
            .bind::<Text, _>(error.as_str())
            .bind_ids([row.id])
            .execute(c)
    })?;
    record_error(conn, row.id, Some(row.attempt), &error)?;
    Ok(Some(error))
}

/// The error of a job a snooze left dead.
fn out_of_attempts(snoozes: i64) -> String {
    format!("snoozed {snoozes} times; out of attempts")
}

/// Marks claimed jobs completed. Inside the caller's transaction it commits (or rolls back)
/// with the handler's own writes: the exactly-once way to finish a job, provided the caller
/// rolls back when the outcome is not [`Outcome::Done`] (the call itself succeeds then).
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use std::time::Duration;
/// # use tenure::jobs::{self, NewJob, Outcome};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// # jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))?;
/// let job = jobs::claim(&mut conn, "q", 1, Duration::from_secs(60))?.remove(0);
/// tenure::transaction(&mut conn, |conn| -> Result<(), Box<dyn std::error::Error>> {
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
pub fn complete<C: TenureConnection>(conn: &mut C, claims: &[JobClaim]) -> Result<Vec<Outcome>> {
    finish(conn, claims, Finish::Complete(&[]))
}

/// [`complete`], keeping results for the jobs listed in `results` (validated by
/// [`JobResult`]'s constructors) with the jobs this call completes.
pub(crate) fn complete_with_results<C: TenureConnection>(
    conn: &mut C,
    claims: &[JobClaim],
    results: &[(i64, &JobResult)],
) -> Result<Vec<Outcome>> {
    finish(conn, claims, Finish::Complete(results))
}

/// Extends claims to the database's now + `ttl` (a heartbeat). `Lost` for a claim that was
/// rescued or taken over: the worker should stop.
pub fn renew<C: TenureConnection>(
    conn: &mut C,
    claims: &[JobClaim],
    ttl: Duration,
) -> Result<Vec<Outcome>> {
    let micros = validate::ttl(ttl)?;
    finish(conn, claims, Finish::Renew(micros))
}

/// Puts claimed jobs back, due at once; the run does not count as an attempt.
pub fn give_back<C: TenureConnection>(conn: &mut C, claims: &[JobClaim]) -> Result<Vec<Outcome>> {
    finish(conn, claims, Finish::GiveBack)
}

/// Records a failed run: with attempts left and a `retry` other than [`Retry::Never`], the
/// job waits for its retry; otherwise it is dead. The error (cut to
/// [`MAX_ERROR_BYTES`]) is kept with the job. A [`Retry::At`] outside the years 1 to 9999 or a
/// [`Retry::After`] longer than 366 days is [`Error::InvalidInput`], before any statement.
pub fn fail<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
    error: &str,
    retry: Retry,
) -> Result<Outcome> {
    retry.check()?;
    let outcomes = finish(conn, &[claim], Finish::Fail { error, retry })?;
    Ok(outcomes.into_iter().next().unwrap_or(Outcome::Lost))
}

/// Puts a claimed job back for later: waiting again, due at the database's now + `delay`
/// (zero: at once), its claim ended. The run does not use an attempt, for the job's first
/// [`MAX_FREE_SNOOZES`] snoozes (counted in [`Job::snoozes`](crate::jobs::Job::snoozes)); every
/// further snooze uses one, and a job whose attempts are then used up is dead, with the error
/// "snoozed N times; out of attempts". Fenced by the claim's token like [`fail`]: a repeat
/// of the call answers [`Outcome::AlreadyDone`], a lost claim [`Outcome::Lost`], a job asked
/// to cancel is cancelled ([`Outcome::Cancelled`]). A `delay` longer than 366 days is
/// [`Error::InvalidInput`], before any statement.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob, Outcome};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("sync", "account", vec![]))?.id;
/// let job = jobs::claim(&mut conn, "sync", 1, Duration::from_secs(60))?.remove(0);
/// // The remote side asks us to come back in a minute: no attempt used.
/// assert_eq!(jobs::snooze(&mut conn, job.claim(), Duration::from_secs(60))?, Outcome::Done);
/// let stored = jobs::get(&mut conn, id)?.unwrap();
/// assert_eq!((stored.attempt, stored.snoozes), (0, 1));
/// assert!(jobs::claim(&mut conn, "sync", 1, Duration::from_secs(60))?.is_empty());
/// # Ok(()) }
/// ```
pub fn snooze<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
    delay: Duration,
) -> Result<Outcome> {
    snooze_noting_death(conn, claim, delay).map(|(outcome, _)| outcome)
}

/// [`snooze`], also giving the error recorded if the snooze left the job dead (out of
/// attempts past the free snoozes): the worker reports such a run as dead, as the database
/// records it.
pub(crate) fn snooze_noting_death<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
    delay: Duration,
) -> Result<(Outcome, Option<String>)> {
    let micros = validate::delay_micros(delay)?;
    let mut died = Vec::new();
    let outcomes = finish_noting(conn, &[claim], Finish::Snooze(micros), &mut died)?;
    let outcome = outcomes.into_iter().next().unwrap_or(Outcome::Lost);
    let error = match outcome {
        Outcome::Done | Outcome::AlreadyDone => died
            .into_iter()
            .find(|(id, _)| *id == claim.id)
            .map(|(_, error)| error),
        Outcome::Lost | Outcome::Cancelled => None,
    };
    Ok((outcome, error))
}

/// How many different ids: the rows a statement over them changes (a batch may name a job
/// twice).
fn distinct(ids: impl Iterator<Item = i64>) -> usize {
    ids.collect::<std::collections::BTreeSet<i64>>().len()
}

//! Claiming due jobs (within their concurrency limits) and rescuing lapsed claims (and,
//! through `workers`, the claims of dead workers).

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use super::dependencies::settle;
use super::finish::record_error;
use super::model::{Candidate, IdRow, IdStateRow, JobRow, LockedClaim};
use super::{ClaimedJob, JobState, MAX_KINDS, MAX_LAPSES, Rescued, admission, check_limit, ids_of};
use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::transaction::bare_write_transaction;
use crate::transaction::retry_transient;
use crate::{Error, Result, TenureConnection, validate};

/// What a claim reads back of the jobs it claimed ([`model::JobRow`]).
const CLAIMED_COLUMNS: &str = "id, queue, kind, payload, priority, attempt, max_attempts, \
    due_at, created_at, claim_token, claimed_at, claim_expires_at";

/// Claim, step 1 of 3: lock the jobs to claim, in order, skipping rows other claimers hold
/// (SQLite: the IMMEDIATE transaction serializes claimers), at most as many as a limited
/// queue has room for (step 0). Nothing from a paused queue. Subqueries are plain reads: a locking
/// clause does not lock what they read. Jobs with a key that has no room now (its running
/// jobs fill the smallest cap among them, or the rate it is throttled on is full and the job's
/// rate on it is as strict or stricter: `throttled_until`) are left out, so they do not crowd
/// out the others; these reads are only a filter (step 2 decides under the locks).
/// A job without limits (`limit_key IS NULL`) never reads `tenure_job_limits`. The index on
/// `(queue, [state,] priority, due_at, id)` serves filter and order, so InnoDB reads (and
/// locks) only the rows it returns. MySQL rejects LIMIT in an `IN (subquery)`, hence
/// separate statements. `{kinds}` is empty for a claim of any kind (see [`KIND_FILTER`]).
const CLAIM_PICK: &str = "\
    SELECT id, priority, due_at, limit_key FROM tenure_jobs{index} \
    WHERE queue = ? AND state = 'waiting' AND due_at <= {now}{kinds} \
      AND NOT EXISTS (SELECT 1 FROM tenure_queue_pauses p WHERE p.queue = ?) \
      AND (limit_key IS NULL OR NOT EXISTS ( \
          SELECT 1 FROM tenure_job_limits l WHERE l.job_id = tenure_jobs.id AND ( \
              (l.rate_max IS NOT NULL AND EXISTS ( \
                  SELECT 1 FROM tenure_limit_keys t WHERE t.limit_key = l.limit_key \
                  AND t.throttled_until > {now} AND l.rate_max <= t.throttled_max \
                  AND l.rate_period_us >= t.throttled_period_us)) \
              OR (l.max_running IS NOT NULL AND l.limit_key IN ( \
                  SELECT s.limit_key FROM tenure_jobs r JOIN tenure_job_limits s ON s.job_id = r.id \
                  WHERE r.state = 'running' AND r.limit_key IS NOT NULL AND s.max_running IS NOT NULL \
                  GROUP BY s.limit_key HAVING COUNT(*) >= MIN(s.max_running)))))) \
    ORDER BY priority, due_at, id LIMIT ?{skip_locked}";

/// A claim of some kinds picks per kind, served by `tenure_jobs_claim_kind`
/// `(queue, [state,] kind, priority, due_at, id)`: one kind is one range of it, read in claim
/// order and skipping rows other claimers hold, so waiting jobs of other kinds are never read
/// nor locked however many sit ahead. Several kinds are one such pick each (up to `limit`
/// rows each), merged in claim order and cut to `limit`: the same jobs one pick over the
/// listed kinds would take, without sorting (or, on MySQL/MariaDB, locking) every due job
/// of those kinds. Rows picked and not kept stay locked only until the claim commits.
const KIND_FILTER: &str = " AND kind = ?";

/// Claim, step 3: claim exactly the accepted ids (a bound list, see `backend::statement`),
/// each with its own random token, recording the worker that claims (NULL outside a worker).
/// The WHERE is the primary key alone, so no other index can serve it (a `state = ...`
/// condition could be served by the stalled-claims index on MySQL, locking other rows).
/// RETURNING where there is one; MySQL reads them back.
const CLAIM_MARK: &str = "\
    UPDATE tenure_jobs SET state = 'running', attempt = attempt + 1, \
        claim_token = {random_token}, claimed_at = {now}, claim_expires_at = {now+ttl}, \
        claimed_by = ? \
    WHERE id IN {ids}";

/// Rescue, step 3: return lapsed claims (or a dead worker's) to the queue without using an
/// attempt (the worker may have died before the run began: jobs claimed ahead never start,
/// and nothing records whether a run began), counting the lapse;
/// a job asked to cancel is cancelled; a job whose claims lapsed [`MAX_LAPSES`] times (it
/// takes its worker down every time) is dead. Only rows this transaction holds locked and
/// found stalled (step 2), so a job completed or renewed meanwhile is left alone. The WHERE
/// is the primary key alone: with a condition on `state`, MariaDB may serve the UPDATE from
/// an index on `state` and lock rows other transactions hold (that deadlocked with
/// heartbeats in the race test). MySQL assigns left to right, reading the values assigned
/// before: `state` and `lapses` come last, so every CASE reads the row as it was.
const RESCUE_SET: &str = "\
    UPDATE tenure_jobs SET \
        finished_at = CASE WHEN cancel_requested_at IS NOT NULL OR lapses + 1 >= ? \
            THEN {now} ELSE NULL END, \
        last_error = ?, \
        attempt = attempt - 1, \
        claim_token = NULL, claim_expires_at = NULL, due_at = {now}, \
        state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' \
            WHEN lapses + 1 >= ? THEN 'dead' ELSE 'waiting' END, \
        lapses = lapses + 1 \
    WHERE id IN {ids}";

/// The error a rescued run leaves in the job's history (and as its `last_error`).
const RESCUE_ERROR: &str = "the claim lapsed: the worker stalled or died";

/// Rescue, step 1: candidates, by a plain read of the stalled-claims index. Not a locking
/// read: on MariaDB 10.11 a `FOR UPDATE SKIP LOCKED` scan of this secondary index waits for
/// (instead of skipping) entries a concurrent heartbeat is rewriting, while the heartbeat
/// waits for entries the scan locked: a deadlock (seen in the heartbeat/rescue race test).
const RESCUE_CANDIDATES: &str = "\
    SELECT id FROM tenure_jobs WHERE state = 'running' AND claim_expires_at <= {now} \
    ORDER BY claim_expires_at LIMIT ?";

/// Rescue, step 2: lock the candidates by primary key (`WHERE id IN` only, so no index but
/// the primary key can serve it), skipping rows a heartbeat or a finisher holds, and read
/// them as locked: still stalled is decided on these rows.
const RESCUE_LOCK: &str = "SELECT id, state, claim_expires_at, {now} AS db_now FROM tenure_jobs WHERE id IN {ids}{skip_locked}";

/// Claims up to `limit` due jobs of `queue` for `ttl`, by priority, then due time, then id.
/// Atomic: no job is ever held by two claimers. Each job comes with its attempt number
/// (counting this run) and a fresh claim token. Needs a bare connection.
///
/// In one transaction (READ COMMITTED on PostgreSQL and MySQL/MariaDB, IMMEDIATE on SQLite):
/// `SELECT ... FOR UPDATE SKIP LOCKED` of the ids in order (no locking clause on SQLite),
/// the concurrency limits of any limit keys among them decided under each key's lock, then
/// `UPDATE` by that id list (`RETURNING` on PostgreSQL and SQLite, a read back on MySQL).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// jobs::enqueue(&mut conn, &NewJob::new("mail", "welcome", vec![]))?;
/// let claimed = jobs::claim(&mut conn, "mail", 10, Duration::from_secs(60))?;
/// assert_eq!(claimed.len(), 1);
/// assert!(claimed[0].claimed_at >= claimed[0].created_at);
/// # Ok(()) }
/// ```
pub fn claim<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    limit: usize,
    ttl: Duration,
) -> Result<Vec<ClaimedJob>> {
    Ok(claim_of(conn, queue, None, limit, ttl, None)?.0)
}

/// Like [`claim`], taking only jobs whose kind is one of `kinds` (1 to [`MAX_KINDS`]; repeats
/// are harmless), still in the queue's order: by priority, then due time, then id, across
/// the kinds given. Jobs of other kinds are never claimed, locked or changed, however many
/// of them wait ahead (the pick reads an index on `(queue, kind, ...)`: one range per kind).
/// An empty list, more than [`MAX_KINDS`] kinds or an invalid name is [`Error::InvalidInput`],
/// before any statement.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// jobs::enqueue(&mut conn, &NewJob::new("media", "video", vec![]))?;
/// let thumb = jobs::enqueue(&mut conn, &NewJob::new("media", "thumbnail", vec![]))?.id;
/// let claimed = jobs::claim_kinds(&mut conn, "media", &["thumbnail"], 10, Duration::from_secs(60))?;
/// assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![thumb]);
/// # Ok(()) }
/// ```
///
/// [`Error::InvalidInput`]: crate::Error::InvalidInput
pub fn claim_kinds<C: TenureConnection, K: AsRef<str>>(
    conn: &mut C,
    queue: &str,
    kinds: &[K],
    limit: usize,
    ttl: Duration,
) -> Result<Vec<ClaimedJob>> {
    let names = kind_names(kinds)?;
    Ok(claim_of(conn, queue, Some(&names), limit, ttl, None)?.0)
}

/// The kinds validated (1 to [`MAX_KINDS`]), sorted and without repeats: one statement shape
/// per list length, and a repeat is harmless in IN.
fn kind_names<K: AsRef<str>>(kinds: &[K]) -> Result<Vec<&str>> {
    if kinds.is_empty() {
        return Err(Error::invalid("kinds", "an empty list"));
    }
    if kinds.len() > MAX_KINDS {
        return Err(Error::invalid(
            "kinds",
            format!("{} kinds, the most is {MAX_KINDS}", kinds.len()),
        ));
    }
    let mut names: Vec<&str> = Vec::with_capacity(kinds.len());
    for kind in kinds {
        validate::name("kind", kind.as_ref())?;
        names.push(kind.as_ref());
    }
    names.sort_unstable();
    names.dedup();
    Ok(names)
}

/// [`claim_kinds`] for the registered worker `worker` (`tenure_workers`, recorded as the
/// claims' `claimed_by`, or none), and how long until the soonest rate this claim found full
/// has room again (by the database's clock): when a worker finding nothing to claim may look
/// again.
pub(crate) fn claim_kinds_throttled<C: TenureConnection, K: AsRef<str>>(
    conn: &mut C,
    queue: &str,
    kinds: &[K],
    limit: usize,
    ttl: Duration,
    worker: Option<i64>,
) -> Result<(Vec<ClaimedJob>, Option<Duration>)> {
    let names = kind_names(kinds)?;
    claim_of(conn, queue, Some(&names), limit, ttl, worker)
}

/// [`claim`], of the given kinds only (`Some`, validated and non-empty) or of any kind, by
/// `worker` if a registered worker claims, and how long until the soonest rate it found full
/// has room again.
fn claim_of<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    kinds: Option<&[&str]>,
    limit: usize,
    ttl: Duration,
    worker: Option<i64>,
) -> Result<(Vec<ClaimedJob>, Option<Duration>)> {
    validate::name("queue", queue)?;
    let micros = validate::ttl(ttl)?;
    let limit = check_limit(limit)?;
    let (rows, throttled_for): (Vec<JobRow>, Option<Duration>) = dispatch!(conn, c => {
        bare_write_transaction(c, "claiming jobs", |c| {
            let syntax = c.syntax();
            // Step 0: a limited queue's lock, before any job row is locked (one order for
            // every claimer: queue, jobs, keys), and its room; none left, nothing to pick.
            let queue_room = admission::lock_queue(c, queue)?;
            let limit = match queue_room {
                Some(room) if room <= 0 => return Ok((Vec::new(), None)),
                Some(room) => limit.min(room),
                None => limit,
            };
            // A paused queue yields no candidates (the pick's NOT EXISTS), in the same
            // statement.
            let candidates = match kinds {
                None => {
                    let pick = CLAIM_PICK.replace("{index}", "{claim_index}").replace("{kinds}", "");
                    statement(syntax.render(&pick))
                        .bind::<Text, _>(queue)
                        .bind::<Text, _>(queue)
                        .bind::<BigInt, _>(limit)
                        .load::<Candidate>(c)?
                }
                Some(kinds) => {
                    let pick = syntax.render(
                        &CLAIM_PICK.replace("{index}", "{claim_kind_index}").replace("{kinds}", KIND_FILTER),
                    );
                    let mut candidates = Vec::new();
                    for kind in kinds {
                        candidates.extend(
                            statement(pick.clone())
                                .bind::<Text, _>(queue)
                                .bind::<Text, _>(*kind)
                                .bind::<Text, _>(queue)
                                .bind::<BigInt, _>(limit)
                                .load::<Candidate>(c)?,
                        );
                    }
                    candidates.sort_by_key(|c| (c.priority, c.due_at, c.id));
                    candidates.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
                    candidates
                }
            };
            let admission = admission::admit(c, queue, queue_room, &candidates)?;
            if admission.ids.is_empty() {
                // Rates whose windows filled meanwhile still get their hints.
                let throttled_for = admission::record_starts(c, &admission, &[])?;
                return Ok((Vec::new(), throttled_for));
            }
            let ids = admission.ids.clone();
            let mark = syntax.render(CLAIM_MARK);
            let rows = if syntax.returning {
                statement(format!("{mark} RETURNING {CLAIMED_COLUMNS}"))
                    .bind::<BigInt, _>(micros)
                    .bind::<Nullable<BigInt>, _>(worker)
                    .bind_ids(ids)
                    .load::<JobRow>(c)?
            } else {
                statement(mark)
                    .bind::<BigInt, _>(micros)
                    .bind::<Nullable<BigInt>, _>(worker)
                    .bind_ids(ids.iter().copied())
                    .execute(c)?;
                statement(format!("SELECT {CLAIMED_COLUMNS} FROM tenure_jobs WHERE id IN {{ids}}"))
                    .bind_ids(ids)
                    .load::<JobRow>(c)?
            };
            let starts: Vec<_> = rows
                .iter()
                .filter_map(|row| row.claimed_at.map(|at| (row.id, at)))
                .collect();
            let throttled_for = admission::record_starts(c, &admission, &starts)?;
            Ok((rows, throttled_for))
        })
    })?;
    let mut claimed = rows
        .into_iter()
        .map(ClaimedJob::from_row)
        .collect::<Result<Vec<_>>>()?;
    // The order the claim took them in (RETURNING has none).
    claimed.sort_by_key(|job| (job.priority, job.due_at, job.id));
    Ok((claimed, throttled_for))
}

/// Returns stalled jobs to the queue, due at once, up to `limit` per call: jobs whose claim
/// lapsed by the database's clock, and jobs claimed by a worker that died (its lock is free:
/// its process, or its database session, ended; see [`crate::worker`], "When a worker
/// dies"). A rescued claim uses no attempt (the worker may have died before the run began:
/// jobs it claimed ahead never started) but counts as a lapse: a job whose claims lapsed
/// [`MAX_LAPSES`] times is dead. A job asked to cancel while it ran is cancelled. Needs a bare
/// connection.
///
/// A worker is judged dead only once its lock has been found free for a few seconds (on
/// PostgreSQL and MySQL/MariaDB, so that a live worker whose connection dropped, or a server
/// that restarted, leaves it time to take its lock again): a call may only note that a lock is
/// free, and a later call takes the claims back. Workers call this themselves.
pub fn rescue<C: TenureConnection>(conn: &mut C, limit: usize) -> Result<Rescued> {
    let mut rescued = rescue_lapsed(conn, limit)?;
    let taken = rescued.requeued.len() + rescued.dead.len() + rescued.cancelled.len();
    if taken < limit {
        let dead = super::workers::rescue_dead(conn, limit - taken)?;
        rescued.requeued.extend(dead.requeued);
        rescued.dead.extend(dead.dead);
        rescued.cancelled.extend(dead.cancelled);
        rescued.requeued.sort_unstable();
        rescued.dead.sort_unstable();
        rescued.cancelled.sort_unstable();
    }
    Ok(rescued)
}

/// [`rescue`] of lapsed claims only (what a worker does every ttl/2).
pub(crate) fn rescue_lapsed<C: TenureConnection>(conn: &mut C, limit: usize) -> Result<Rescued> {
    let limit = check_limit(limit)?;
    // A deadlock with a cancel or an enqueue locking in id order (the settle below locks
    // dependents of lower id than jobs it rescued) runs the rescue again.
    let (rows, released): (Vec<IdStateRow>, Vec<String>) = retry_transient(|| {
        dispatch!(conn, c => {
            bare_write_transaction(c, "rescuing stalled jobs", |c| {
                let syntax = c.syntax();
                let candidates: Vec<i64> = statement(syntax.render(RESCUE_CANDIDATES))
                    .bind::<BigInt, _>(limit)
                    .load::<IdRow>(c)
                    .map(ids_of)?;
                if candidates.is_empty() {
                    return Ok((Vec::new(), Vec::new()));
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
                requeue(c, ids, RESCUE_ERROR)
            })
        })
    })?;
    crate::wake::wake(released.iter().map(String::as_str));
    let mut rescued = Rescued::default();
    tally(rows, &mut rescued)?;
    Ok(rescued)
}

/// Rescue, the common part: returns the claims of `ids` (running, locked by the caller's
/// transaction, which found them to rescue) to the queue as `RESCUE_SET` says, with `error`
/// in their history, and settles the dependents of those it ended. Returns their states and
/// the queues of the dependents it released.
pub(super) fn requeue<C: TenureConnection>(
    c: &mut C,
    ids: Vec<i64>,
    error: &str,
) -> Result<(Vec<IdStateRow>, Vec<String>)> {
    if ids.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    // The history names the run that lapsed: before the attempt is given back.
    for id in &ids {
        record_error(c, *id, None, error)?;
    }
    dispatch!(c, c => {
        statement(c.syntax().render(RESCUE_SET))
            .bind::<Integer, _>(MAX_LAPSES as i32)
            .bind::<Text, _>(error)
            .bind::<Integer, _>(MAX_LAPSES as i32)
            .bind_ids(ids.iter().copied())
            .execute(c)
    })?;
    let rows = dispatch!(c, c => {
        statement("SELECT id, state FROM tenure_jobs WHERE id IN {ids}")
            .bind_ids(ids)
            .load::<IdStateRow>(c)
    })?;
    // Jobs the rescue ended (dead or cancelled): their dependents follow, here.
    let ended: Vec<(i64, JobState)> = rows
        .iter()
        .filter_map(|row| match JobState::parse(&row.state) {
            Ok(state @ (JobState::Dead | JobState::Cancelled)) => Some((row.id, state)),
            _ => None,
        })
        .collect();
    let released = if ended.is_empty() {
        Vec::new()
    } else {
        settle(c, ended)?
    };
    Ok((rows, released))
}

/// Adds rescued jobs to `rescued` by the state the rescue left them in.
pub(super) fn tally(rows: Vec<IdStateRow>, rescued: &mut Rescued) -> Result<()> {
    for row in rows {
        match JobState::parse(&row.state)? {
            JobState::Waiting => rescued.requeued.push(row.id),
            JobState::Dead => rescued.dead.push(row.id),
            JobState::Cancelled => rescued.cancelled.push(row.id),
            // Not possible for rows the rescue locked and found to rescue.
            JobState::Blocked | JobState::Running | JobState::Completed => {}
        }
    }
    rescued.requeued.sort_unstable();
    rescued.dead.sort_unstable();
    rescued.cancelled.sort_unstable();
    Ok(())
}

//! Rescue, in one place: returning stalled jobs to the queue ([`rescue`]). A claim is stalled
//! when it lapsed by the database's clock ([`rescue_lapsed`], what a worker does every ttl/2)
//! or when the worker that holds it died ([`rescue_dead`]): a dead worker is recognised by its
//! lock ([`crate::jobs::registry`]), which lasts exactly as long as its process (its database
//! session on a server, its process on SQLite), not by a timer. A stalled process (a long
//! pause, SIGSTOP, a machine at load 10) keeps its lock and is never taken for dead; its
//! claims are then protected by their ttl, as a claim made outside a worker always is.
//!
//! A rescue of dead workers looks at the workers that have been silent for [`SILENT_AFTER`]
//! (or whose lock was found free), and takes one for dead when:
//!
//! - **SQLite**: its lock file is not locked. Every process of the file is on this host and
//!   the lock ends only with the worker's process: nothing else can free it.
//! - **PostgreSQL, MySQL/MariaDB**: its lock is free (its session ended), **and** it has been
//!   silent for [`SILENT_AFTER`], **and** rescues have found its lock free for
//!   [`LOCK_FREE_FOR`] (`lock_free_since`, cleared when found held). A session can end while
//!   its process lives (a server restart or failover, a killed connection, a network
//!   reset): the worker then goes on writing its heartbeat through its other connections
//!   and takes its lock again on a new connection within about a second. The heartbeat
//!   covers a lock connection that cannot be made again while the others work; the time
//!   the lock must have been seen free covers a restart, which stops every connection's
//!   heartbeats at once: it is counted from the first rescue that saw the server again.
//!   Only a worker that could reach the database neither to write its heartbeat nor to take
//!   its lock for those seconds is taken for dead: like a claim that lapsed, only sooner.
//!
//! A dead worker's claims are returned as lapsed claims are (no attempt used, a lapse
//! counted), its row is deleted. A worker whose row was deleted while it lived (it had been
//! cut off) finds out at its next heartbeat and registers again; its claims made since keep
//! their ttl. A rescue never judges a registration of its own process (it lives).

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use super::errors::record_error;
use super::model::LockedClaim;
use super::{JobState, MAX_LAPSES, Rescued, check_count, ids_of};
use crate::backend::statement::statement;
use crate::backend::transaction::{bare_write_transaction, retry_transient};
use crate::backend::{Dialect, FileLock, Liveness, LockSpace, Probe, dispatch};
use crate::jobs::registry::{FORGET, HELD_JOBS, held_here};
use crate::jobs::workflows::dependencies::settle;
use crate::rows::{IdRow, IdStateRow};
use crate::sql_types::Instant;
use crate::{Result, TenureConnection};

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
///
/// A lapse counts against a job (`lapses`) the first time, and after that only when its run
/// had begun (`started_at`, recorded by a worker before it runs a job with lapses, one such
/// run at a time per worker, and by a claim made outside a worker): the jobs a crashing
/// worker claimed ahead never started, and are never charged its crashes.
const RESCUE_SET: &str = "\
    UPDATE tenure_jobs SET \
        finished_at = CASE WHEN cancel_requested_at IS NOT NULL \
            OR ((lapses = 0 OR started_at IS NOT NULL) AND lapses + 1 >= ?) \
            THEN {now} ELSE NULL END, \
        last_error = ?, \
        attempt = attempt - 1, \
        claim_token = NULL, claim_expires_at = NULL, due_at = {now}, \
        state = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' \
            WHEN (lapses = 0 OR started_at IS NOT NULL) AND lapses + 1 >= ? THEN 'dead' \
            ELSE 'waiting' END, \
        lapses = CASE WHEN lapses = 0 OR started_at IS NOT NULL THEN lapses + 1 ELSE lapses END \
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

/// A worker that wrote no heartbeat for this long is looked at by rescues: is its lock free?
const SILENT_AFTER: Duration = Duration::from_secs(2);

/// On a server, a worker's lock must have been found free for this long (and the worker be
/// silent) before it is taken for dead: the time a live worker has to take it again.
const LOCK_FREE_FOR: Duration = Duration::from_secs(3);

/// The most silent workers one pass looks at.
const LOOK_AT: i64 = 16;

/// The error a dead worker's rescued run leaves in the job's history.
const DIED: &str = "the worker holding the claim died (its lock was released)";

/// Workers silent since `{now+ttl}` (the bind is minus [`SILENT_AFTER`]), or whose lock a
/// rescue found free. A plain read of a small table.
const SILENT: &str = "\
    SELECT id FROM tenure_workers WHERE heartbeat_at <= {now+ttl} OR lock_free_since IS NOT NULL \
    ORDER BY id LIMIT ?";

/// A silent worker's row, locked (skipped if another rescue has it).
const LOCK_WORKER: &str = "\
    SELECT heartbeat_at, lock_free_since, {now} AS db_now FROM tenure_workers \
    WHERE id = ?{skip_locked}";

const MARK_FREE: &str = "UPDATE tenure_workers SET lock_free_since = {now} WHERE id = ?";
const MARK_HELD: &str = "UPDATE tenure_workers SET lock_free_since = NULL WHERE id = ?";
/// Those jobs locked by primary key (skipping rows another transaction holds) and read as
/// locked: still running under the worker's claim is decided on these rows.
const LOCK_HELD_JOBS: &str = "\
    SELECT id, state, claimed_by FROM tenure_jobs WHERE id IN {ids}{skip_locked}";

#[derive(QueryableByName)]
struct WorkerRow {
    #[diesel(sql_type = Instant)]
    heartbeat_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Instant>)]
    lock_free_since: Option<DateTime<Utc>>,
    #[diesel(sql_type = Instant)]
    db_now: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct HeldJob {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    claimed_by: Option<i64>,
}

/// Returns stalled jobs to the queue, due at once, up to `max_jobs` per call: jobs whose claim
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
pub fn rescue<C: TenureConnection>(conn: &mut C, max_jobs: usize) -> Result<Rescued> {
    let mut rescued = rescue_lapsed(conn, max_jobs)?;
    let taken = rescued.requeued.len() + rescued.dead.len() + rescued.cancelled.len();
    if taken < max_jobs {
        let dead = rescue_dead(conn, max_jobs - taken)?;
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
pub(crate) fn rescue_lapsed<C: TenureConnection>(conn: &mut C, max_jobs: usize) -> Result<Rescued> {
    let max_jobs = check_count(max_jobs)?;
    // A deadlock with a cancel or an enqueue locking in id order (the settle below locks
    // dependents of lower id than jobs it rescued) runs the rescue again.
    let (rows, released): (Vec<IdStateRow>, Vec<String>) = retry_transient(|| {
        dispatch!(conn, c => {
            bare_write_transaction(c, "rescuing stalled jobs", |c| {
                let syntax = c.syntax();
                let candidates: Vec<i64> = statement(syntax.render(RESCUE_CANDIDATES))
                    .bind::<BigInt, _>(max_jobs)
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
    if !rows.is_empty() {
        // Some may have ended (dead, or cancelled): their waiters look.
        super::wait::ended();
    }
    let mut rescued = Rescued::default();
    tally(rows, &mut rescued)?;
    Ok(rescued)
}

/// Rescue, the common part: returns the claims of `ids` (running, locked by the caller's
/// transaction, which found them to rescue) to the queue as `RESCUE_SET` says, with `error`
/// in their history, and settles the dependents of those it ended. Returns their states and
/// the queues of the dependents it released.
fn requeue<C: TenureConnection>(
    c: &mut C,
    ids: Vec<i64>,
    error: &str,
) -> Result<(Vec<IdStateRow>, Vec<String>)> {
    if ids.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    // Runs that parked their job handed its token out: the job waits for that token (parked,
    // or an answer that came meanwhile applied, its dependents settled there), not requeued.
    let (parked, mut released) = crate::jobs::parked::park_rescued_runs(c, &ids)?;
    let requeued: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !parked.contains(id))
        .collect();
    if !requeued.is_empty() {
        // The history names the run that lapsed: before the attempt is given back.
        for id in &requeued {
            record_error(c, *id, None, error)?;
        }
        dispatch!(c, c => {
            statement(c.syntax().render(RESCUE_SET))
                .bind::<Integer, _>(MAX_LAPSES as i32)
                .bind::<Text, _>(error)
                .bind::<Integer, _>(MAX_LAPSES as i32)
                .bind_ids(requeued.iter().copied())
                .execute(c)
        })?;
    }
    let rows = dispatch!(c, c => {
        statement("SELECT id, state FROM tenure_jobs WHERE id IN {ids}")
            .bind_ids(ids)
            .load::<IdStateRow>(c)
    })?;
    // Jobs the rescue ended (dead or cancelled): their dependents follow, here.
    let ended: Vec<(i64, JobState)> = rows
        .iter()
        .filter(|row| !parked.contains(&row.id))
        .filter_map(|row| match JobState::parse(&row.state) {
            Ok(state @ (JobState::Dead | JobState::Cancelled)) => Some((row.id, state)),
            _ => None,
        })
        .collect();
    if !ended.is_empty() {
        released.extend(settle(c, ended)?);
    }
    Ok((rows, released))
}

/// Adds rescued jobs to `rescued` by the state the rescue left them in.
fn tally(rows: Vec<IdStateRow>, rescued: &mut Rescued) -> Result<()> {
    for row in rows {
        match JobState::parse(&row.state)? {
            JobState::Waiting => rescued.requeued.push(row.id),
            JobState::Dead => rescued.dead.push(row.id),
            JobState::Cancelled => rescued.cancelled.push(row.id),
            // Parked (a run that parked: see `requeue`), or ended by an answer that came
            // before the rescue; the others are not possible for rows it found to rescue.
            JobState::Blocked | JobState::Running | JobState::Parked | JobState::Completed => {}
        }
    }
    rescued.requeued.sort_unstable();
    rescued.dead.sort_unstable();
    rescued.cancelled.sort_unstable();
    Ok(())
}

/// What one look at a silent worker found.
struct Pass {
    rows: Vec<IdStateRow>,
    released: Vec<String>,
    /// Its lock file, locked, once the worker is forgotten (SQLite): removed after the commit.
    file: Option<FileLock>,
}

/// Takes back the claims of dead workers (see the module's docs), up to `max_jobs` jobs.
pub(crate) fn rescue_dead<C: TenureConnection>(conn: &mut C, max_jobs: usize) -> Result<Rescued> {
    let max_jobs = check_count(max_jobs)?;
    let syntax = dispatch!(any conn, c => c.syntax());
    // SQLite: the lock alone decides (its workers are never silent for long enough to
    // matter, and nothing but their death frees their locks), so every worker is looked at.
    let by_lock_alone = syntax.lock_ends_with_process;
    let silent = if by_lock_alone {
        Duration::ZERO
    } else {
        SILENT_AFTER
    };
    let silent_micros = -(silent.as_micros() as i64);
    let mut candidates: Vec<i64> = dispatch!(conn, c => {
        statement(c.syntax().render(SILENT))
            .bind::<BigInt, _>(silent_micros)
            .bind::<BigInt, _>(LOOK_AT)
            .load::<IdRow>(c)
    })
    .map(ids_of)?;
    if let Some(ours) = held_here().as_ref() {
        candidates.retain(|id| !ours.contains(id));
    }
    let mut rescued = Rescued::default();
    let mut left = max_jobs;
    for id in candidates {
        if left <= 0 {
            break;
        }
        // SQLite: every worker is a candidate, and a write transaction takes the file's one
        // write lock: look at its lock file first (it is looked at again in the transaction).
        if by_lock_alone
            && !matches!(
                dispatch!(conn, c => c.probe_liveness_lock(LockSpace::Worker, id))?,
                Probe::Free(_)
            )
        {
            continue;
        }
        let pass = retry_transient(|| {
            dispatch!(conn, c => {
                bare_write_transaction(c, "rescuing a dead worker's jobs", |c| {
                    look_at(c, id, by_lock_alone, left)
                })
            })
        })?;
        crate::wake::wake(pass.released.iter().map(String::as_str));
        if let Some(file) = pass.file {
            file.remove();
        }
        if !pass.rows.is_empty() {
            tracing::info!(
                target: "tenure::worker",
                worker = id,
                jobs = pass.rows.len(),
                "took back the claims of a dead worker (its lock was released)"
            );
        }
        if !pass.rows.is_empty() {
            // Some may have ended (dead, cancelled, or answered while parking): their
            // waiters look.
            super::wait::ended();
        }
        left -= pass.rows.len() as i64;
        tally(pass.rows, &mut rescued)?;
    }
    Ok(rescued)
}

/// Runs one statement of this module, with `id` bound, on `c`.
fn execute_for<C: TenureConnection>(c: &mut C, template: &str, id: i64) -> Result<usize> {
    Ok(dispatch!(c, c => {
        statement(c.syntax().render(template)).bind::<BigInt, _>(id).execute(c)
    })?)
}

/// One silent worker, in a transaction: is it dead? If so, its claims (up to `max_jobs`) are
/// taken back, and once none is left its row is deleted.
fn look_at<C: TenureConnection>(
    c: &mut C,
    id: i64,
    by_lock_alone: bool,
    max_jobs: i64,
) -> Result<Pass> {
    let nothing = || Pass {
        rows: Vec::new(),
        released: Vec::new(),
        file: None,
    };
    let row = dispatch!(c, c => {
        statement(c.syntax().render(LOCK_WORKER))
            .bind::<BigInt, _>(id)
            .get_result::<WorkerRow>(c)
            .optional()
    })?;
    let Some(row) = row else {
        // Gone, or another rescue is at it.
        return Ok(nothing());
    };
    let file = match dispatch!(c, c => c.probe_liveness_lock(LockSpace::Worker, id))? {
        Probe::Held | Probe::Unknown => {
            if row.lock_free_since.is_some() {
                execute_for(c, MARK_HELD, id)?;
            }
            return Ok(nothing());
        }
        Probe::Free(file) => file,
    };
    if !by_lock_alone {
        let ago = |d: Duration| row.db_now - chrono::Duration::from_std(d).unwrap_or_default();
        let silent = row.heartbeat_at <= ago(SILENT_AFTER);
        let free_long = row
            .lock_free_since
            .is_some_and(|at| at <= ago(LOCK_FREE_FOR));
        if !(silent && free_long) {
            if row.lock_free_since.is_none() {
                execute_for(c, MARK_FREE, id)?;
            }
            return Ok(nothing());
        }
    }
    // Dead: its claims come back (one more read than taken: are there more?).
    let mut held: Vec<i64> = dispatch!(c, c => {
        statement(HELD_JOBS)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(max_jobs + 1)
            .load::<IdRow>(c)
    })
    .map(ids_of)?;
    let more = held.len() as i64 > max_jobs;
    held.truncate(usize::try_from(max_jobs).unwrap_or(0));
    let mut ids = Vec::new();
    if !held.is_empty() {
        let locked = dispatch!(c, c => {
            statement(c.syntax().render(LOCK_HELD_JOBS))
                .bind_ids(held.iter().copied())
                .load::<HeldJob>(c)
        })?;
        ids = locked
            .into_iter()
            .filter(|job| job.state == JobState::Running.as_str() && job.claimed_by == Some(id))
            .map(|job| job.id)
            .collect();
    }
    // All of them here (none skipped as locked, none left past `max_jobs`): it is forgotten.
    let all = !more && ids.len() == held.len();
    let (rows, released) = requeue(c, ids, DIED)?;
    if !all {
        return Ok(Pass {
            rows,
            released,
            file: None,
        });
    }
    execute_for(c, FORGET, id)?;
    Ok(Pass {
        rows,
        released,
        file,
    })
}

/// Records that the run of `claim` begins now (database clock), so that a lapse of this
/// claim counts against the job (see `RESCUE_SET` above). A worker calls it,
/// before the handler, for a job whose claims lapsed before. `false`: the claim is no
/// longer held.
pub(crate) fn record_start<C: TenureConnection>(
    conn: &mut C,
    claim: super::JobClaim,
) -> Result<bool> {
    const RECORD_START: &str = "\
        UPDATE tenure_jobs SET started_at = {now} \
        WHERE id = ? AND claim_token = ? AND state = 'running'";
    let changed = crate::transaction(conn, |conn| {
        dispatch!(conn, c => {
            statement(c.syntax().render(RECORD_START))
                .bind::<BigInt, _>(claim.id)
                .bind::<crate::sql_types::Token, _>(claim.token)
                .execute(c)
        })
    })?;
    Ok(changed == 1)
}

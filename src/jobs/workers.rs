//! Workers' registrations (`tenure_workers`) and how a dead worker is recognised: by its lock,
//! which lasts exactly as long as its process (its database session on a server, its
//! process on SQLite), not by a timer. A stalled process (a long pause, SIGSTOP, a machine
//! at load 10) keeps its lock and is never taken for dead; its claims are then protected by
//! their ttl, as a claim made outside a worker always is.
//!
//! A worker registers in one transaction: its row, then its lock (`Liveness`), then the
//! commit, so no one ever sees its row without its lock taken. Its claims record it
//! (`tenure_jobs.claimed_by`). Every second it writes `heartbeat_at`, through a connection
//! other than the lock's. A rescue ([`rescue_dead`]) looks at the workers that have been
//! silent for [`SILENT_AFTER`] (or whose lock was found free), and takes one for dead when:
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

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};

use super::claim::{requeue, tally};
use super::model::{IdRow, IdStateRow};
use super::{JobState, Rescued, check_limit, ids_of};
use crate::backend::statement::statement;
use crate::backend::{Dialect, FileLock, Liveness, Probe, WorkerLock, dispatch};
use crate::sql_types::Instant;
use crate::transaction::{bare_write_transaction, retry_transient, write_turn};
use crate::{Backend, Error, Result, TenureConnection};

/// How often a worker writes its heartbeat and checks that it holds its lock.
pub(crate) const WORKER_BEAT: Duration = Duration::from_secs(1);

/// A worker that wrote no heartbeat for this long is looked at by rescues: is its lock free?
pub(crate) const SILENT_AFTER: Duration = Duration::from_secs(2);

/// On a server, a worker's lock must have been found free for this long (and the worker be
/// silent) before it is taken for dead: the time a live worker has to take it again.
pub(crate) const LOCK_FREE_FOR: Duration = Duration::from_secs(3);

/// How often a worker's claimer looks for dead workers.
pub(crate) const DEAD_WORKERS_EVERY: Duration = Duration::from_millis(500);

/// The most silent workers one pass looks at.
const LOOK_AT: i64 = 16;

/// The error a dead worker's rescued run leaves in the job's history.
const DIED: &str = "the worker holding the claim died (its lock was released)";

const REGISTER: &str = "\
    INSERT INTO tenure_workers (host, pid, started_at, heartbeat_at) VALUES (?, ?, {now}, {now})";

const LAST_INSERT_ID: &str = "SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS id";

const BEAT: &str = "UPDATE tenure_workers SET heartbeat_at = {now} WHERE id = ?";

/// After the worker took its lock again: alive, and its lock no longer free.
const RELOCKED: &str = "\
    UPDATE tenure_workers SET heartbeat_at = {now}, lock_free_since = NULL WHERE id = ?";

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
const FORGET: &str = "DELETE FROM tenure_workers WHERE id = ?";

/// The jobs a worker holds: a plain read of the running jobs (the stalled-claims index),
/// which are few; `claimed_by` has no index of its own.
const HELD_JOBS: &str = "\
    SELECT id FROM tenure_jobs WHERE state = 'running' AND claimed_by = ? ORDER BY id LIMIT ?";

/// Those jobs locked by primary key (skipping rows another transaction holds) and read as
/// locked: still running under the worker's claim is decided on these rows.
const LOCK_HELD_JOBS: &str = "\
    SELECT id, state, claimed_by FROM tenure_jobs WHERE id IN {ids}{skip_locked}";

/// A worker leaving: its claims keep only their ttl. `claimed_by` has no index: the primary
/// key serves the WHERE.
const DETACH: &str =
    "UPDATE tenure_jobs SET claimed_by = NULL WHERE claimed_by = ? AND id IN {ids}";

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

/// The registrations this process holds: a rescue never judges them (their worker lives).
static HELD_HERE: Mutex<Option<HashSet<i64>>> = Mutex::new(None);

fn held_here() -> std::sync::MutexGuard<'static, Option<HashSet<i64>>> {
    HELD_HERE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A registration of this process (removed from [`HELD_HERE`] when dropped).
#[derive(Debug)]
pub(crate) struct HeldHere(i64);

impl Drop for HeldHere {
    fn drop(&mut self) {
        if let Some(ids) = held_here().as_mut() {
            ids.remove(&self.0);
        }
    }
}

/// A worker's registration: its id, its lock, and the mark that this process holds it.
#[derive(Debug)]
pub(crate) struct Registered {
    pub id: i64,
    pub lock: WorkerLock,
    _here: HeldHere,
}

/// Registers a worker of this process on `conn`: its row and its lock, in one transaction (a
/// rescue never sees the row without the lock). On a server the lock belongs to `conn`'s
/// session: keep `conn` open, and only for this, for as long as the worker lives.
pub(crate) fn register<C: TenureConnection>(conn: &mut C, host: &str) -> Result<Registered> {
    crate::validate::label("host", host)?;
    let pid = i64::from(std::process::id());
    let (id, lock) = dispatch!(conn, c => {
        bare_write_transaction(c, "registering a worker", |c| {
            let id = insert_worker(c, host, pid)?;
            match dispatch!(c, c => c.take_worker_lock(id))? {
                Some(lock) => Ok((id, lock)),
                // Only if an id were used twice: nothing is committed.
                None => Err(Error::invalid("worker", format!("the lock of new worker {id} is taken"))),
            }
        })
    })?;
    held_here().get_or_insert_with(HashSet::new).insert(id);
    Ok(Registered {
        id,
        lock,
        _here: HeldHere(id),
    })
}

fn insert_worker<C: TenureConnection>(c: &mut C, host: &str, pid: i64) -> Result<i64> {
    let id = dispatch!(c, c => {
        let syntax = c.syntax();
        let insert = syntax.render(REGISTER);
        if syntax.returning {
            statement(format!("{insert} RETURNING id"))
                .bind::<Text, _>(host)
                .bind::<BigInt, _>(pid)
                .get_result::<IdRow>(c)
        } else {
            statement(insert)
                .bind::<Text, _>(host)
                .bind::<BigInt, _>(pid)
                .execute(c)
                .and_then(|_| statement(LAST_INSERT_ID).get_result::<IdRow>(c))
        }
    })?;
    Ok(id.id)
}

/// Worker `id` says it lives. False when its row is gone: a rescue took it for dead.
pub(crate) fn beat<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    let _turn = write_turn(conn)?;
    let rows = dispatch!(conn, c => {
        statement(c.syntax().render(BEAT)).bind::<BigInt, _>(id).execute(c)
    })?;
    Ok(rows == 1)
}

/// Whether `conn`'s session still holds worker `id`'s lock.
pub(crate) fn holds_lock<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    dispatch!(conn, c => c.holds_worker_lock(id))
}

/// What taking a lost lock again came to.
#[derive(Debug)]
pub(crate) enum Relocked {
    /// Held again, on this connection.
    Held,
    /// Someone holds it: the worker's old session, not yet ended on the server, or a rescue
    /// looking at it. Try again later.
    Busy,
    /// The worker's row is gone (a rescue took it for dead): register again.
    Gone,
}

/// Takes worker `id`'s lock again on `conn` (a new connection, after its first one was
/// lost) and says it lives.
pub(crate) fn relock<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Relocked> {
    if dispatch!(conn, c => c.take_worker_lock(id))?.is_none() {
        return Ok(Relocked::Busy);
    }
    let rows = dispatch!(conn, c => {
        statement(c.syntax().render(RELOCKED)).bind::<BigInt, _>(id).execute(c)
    })?;
    Ok(if rows == 1 {
        Relocked::Held
    } else {
        Relocked::Gone
    })
}

/// A worker leaving (its shutdown): the claims it still holds (runs still in their handler
/// past the grace period) keep only their ttl, as before it registered, and its row is
/// deleted. Its lock is released by the caller afterwards.
pub(crate) fn unregister<C: TenureConnection>(conn: &mut C, id: i64) -> Result<()> {
    retry_transient(|| {
        dispatch!(conn, c => {
            bare_write_transaction(c, "unregistering a worker", |c| {
                loop {
                    let held: Vec<i64> = statement(HELD_JOBS)
                        .bind::<BigInt, _>(id)
                        .bind::<BigInt, _>(super::MAX_BATCH as i64)
                        .load::<IdRow>(c)
                        .map(ids_of)?;
                    if held.is_empty() {
                        break;
                    }
                    statement(DETACH)
                        .bind::<BigInt, _>(id)
                        .bind_ids(held)
                        .execute(c)?;
                }
                statement(FORGET).bind::<BigInt, _>(id).execute(c)?;
                Ok(())
            })
        })
    })
}

/// What one look at a silent worker found.
struct Pass {
    rows: Vec<IdStateRow>,
    released: Vec<String>,
    /// Its lock file, locked, once the worker is forgotten (SQLite): removed after the commit.
    file: Option<FileLock>,
}

/// Takes back the claims of dead workers (see the module's docs), up to `limit` jobs.
pub(crate) fn rescue_dead<C: TenureConnection>(conn: &mut C, limit: usize) -> Result<Rescued> {
    let limit = check_limit(limit)?;
    let backend = conn.backend();
    // SQLite: the lock alone decides (its workers are never silent for long enough to
    // matter, and nothing but their death frees their locks), so every worker is looked at.
    let silent = if backend == Backend::Sqlite {
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
    let mut left = limit;
    for id in candidates {
        if left <= 0 {
            break;
        }
        // SQLite: every worker is a candidate, and a write transaction takes the file's one
        // write lock: look at its lock file first (it is looked at again in the transaction).
        if backend == Backend::Sqlite
            && !matches!(
                dispatch!(conn, c => c.probe_worker_lock(id))?,
                Probe::Free(_)
            )
        {
            continue;
        }
        let pass = retry_transient(|| {
            dispatch!(conn, c => {
                bare_write_transaction(c, "rescuing a dead worker's jobs", |c| {
                    look_at(c, id, backend, left)
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

/// One silent worker, in a transaction: is it dead? If so, its claims (up to `limit`) are
/// taken back, and once none is left its row is deleted.
fn look_at<C: TenureConnection>(c: &mut C, id: i64, backend: Backend, limit: i64) -> Result<Pass> {
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
    let file = match dispatch!(c, c => c.probe_worker_lock(id))? {
        Probe::Held | Probe::Unknown => {
            if row.lock_free_since.is_some() {
                execute_for(c, MARK_HELD, id)?;
            }
            return Ok(nothing());
        }
        Probe::Free(file) => file,
    };
    if backend != Backend::Sqlite {
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
            .bind::<BigInt, _>(limit + 1)
            .load::<IdRow>(c)
    })
    .map(ids_of)?;
    let more = held.len() as i64 > limit;
    held.truncate(usize::try_from(limit).unwrap_or(0));
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
    // All of them here (none skipped as locked, none left past the limit): it is forgotten.
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

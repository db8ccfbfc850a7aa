//! The worker registry (`tenure_workers`): a worker's registration, its heartbeat, and the
//! lock that says its process lives (its database session's lock on a server, a lock file on
//! SQLite), taken again on a new connection when its session ended, and given up when it
//! leaves. Not the worker itself (that is [`crate::worker`]): only its row and its lock.
//!
//! A worker registers in one transaction: its row, then its lock (`Liveness`), then the
//! commit, so no one ever sees its row without its lock taken. Its claims record it
//! (`tenure_jobs.claimed_by`). Every [`WORKER_BEAT`] it writes `heartbeat_at`, through a
//! connection other than the lock's. How a rescue judges a silent worker dead, and takes back
//! its claims, is [`queue::rescue`](mod@crate::jobs::queue::rescue)'s; it reads
//! [`held_here`] so that it never judges a registration of its own process (it lives). A
//! worker whose row was deleted while it lived (it had been cut off) finds out at its next
//! heartbeat and registers again.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use super::queue::ids_of;
use crate::backend::statement::statement;
use crate::backend::transaction::{bare_write_transaction, retry_transient, write_turn};
use crate::backend::{Dialect, Liveness, LivenessLock, LockSpace, dispatch};
use crate::rows::IdRow;
use crate::{Error, Result, TenureConnection};

/// How often a worker writes its heartbeat and checks that it holds its lock.
pub(crate) const WORKER_BEAT: Duration = Duration::from_secs(1);

/// How often a worker's claimer looks for dead workers.
pub(crate) const DEAD_WORKERS_EVERY: Duration = Duration::from_millis(500);

const REGISTER: &str = "\
    INSERT INTO tenure_workers (host, pid, started_at, heartbeat_at) VALUES (?, ?, {now}, {now})";

const BEAT: &str = "UPDATE tenure_workers SET heartbeat_at = {now} WHERE id = ?";

/// After the worker took its lock again: alive, and its lock no longer free.
const RELOCKED: &str = "\
    UPDATE tenure_workers SET heartbeat_at = {now}, lock_free_since = NULL WHERE id = ?";

pub(crate) const FORGET: &str = "DELETE FROM tenure_workers WHERE id = ?";

/// The jobs a worker holds: a plain read of the running jobs (the stalled-claims index),
/// which are few; `claimed_by` has no index of its own.
pub(crate) const HELD_JOBS: &str = "\
    SELECT id FROM tenure_jobs WHERE state = 'running' AND claimed_by = ? ORDER BY id LIMIT ?";

/// The claims a worker holds, by the database's record: read after one of its claims failed
/// without an answer (see [`held_claims`]).
const HELD_CLAIMS: &str = "\
    SELECT id, claim_token FROM tenure_jobs WHERE state = 'running' AND claimed_by = ? \
    ORDER BY id LIMIT ?";

#[derive(QueryableByName)]
struct HeldClaim {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<crate::sql_types::Token>)]
    claim_token: Option<uuid::Uuid>,
}

/// The claims the database records for worker `id` (at most [`crate::jobs::MAX_BATCH`]). A
/// claim that committed while its answer was lost (the connection died at its commit: a
/// failover) leaves jobs recorded as this worker's that the worker never heard of: it gives
/// back those it does not hold, instead of leaving them to lapse.
pub(crate) fn held_claims<C: TenureConnection>(
    conn: &mut C,
    id: i64,
) -> Result<Vec<crate::jobs::JobClaim>> {
    dispatch!(conn, c => {
        let rows = statement(HELD_CLAIMS)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(crate::jobs::MAX_BATCH as i64)
            .load::<HeldClaim>(c)?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                row.claim_token
                    .map(|token| crate::jobs::JobClaim { id: row.id, token })
            })
            .collect())
    })
}

/// A worker leaving: its claims keep only their ttl. `claimed_by` has no index: the primary
/// key serves the WHERE.
const DETACH: &str =
    "UPDATE tenure_jobs SET claimed_by = NULL WHERE claimed_by = ? AND id IN {ids}";

/// The registrations this process holds: a rescue never judges them (their worker lives).
static HELD_HERE: Mutex<Option<HashSet<i64>>> = Mutex::new(None);

pub(crate) fn held_here() -> std::sync::MutexGuard<'static, Option<HashSet<i64>>> {
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
    pub lock: LivenessLock,
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
            match dispatch!(c, c => c.take_liveness_lock(LockSpace::Worker, id))? {
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
        // Every backend returns an insert's columns (MariaDB too: INSERT ... RETURNING).
        statement(format!("{} RETURNING id", syntax.render(REGISTER)))
            .bind::<Text, _>(host)
            .bind::<BigInt, _>(pid)
            .get_result::<IdRow>(c)
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
    dispatch!(conn, c => c.holds_liveness_lock(LockSpace::Worker, id))
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
    if dispatch!(conn, c => c.take_liveness_lock(LockSpace::Worker, id))?.is_none() {
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
                        .bind::<BigInt, _>(crate::jobs::MAX_BATCH as i64)
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

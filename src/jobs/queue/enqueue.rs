//! Enqueueing one job (an upsert where it has a dedup key), and the statements and macros
//! that [`super::bulk`] shares for many.

use std::collections::HashMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};

use super::model::InsertedRow;
use super::{DedupOver, Enqueued, NewJob, OnDuplicate};
use crate::backend::statement::statement;
use crate::backend::transaction::{
    in_transaction, retry_transient, retrying_transaction, write_turn,
};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::jobs::flow::sequences::{self, SequenceFailure};
use crate::jobs::flow::{fairness, limits};
use crate::jobs::workflows::{RunWhen, dependencies};
use crate::rows::IdRow;
use crate::sql_types::Instant;
use crate::wake;
use crate::{Error, Result, TenureConnection};

/// The columns every insert of a job writes, and their values ([`job_row!`] binds them).
macro_rules! insert_columns {
    () => {
        "queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at, \
         dedup_key, limit_key, limit_max, dedup_window_micros, workflow_id, run_when, \
         stripes_pending, sequence_key, fair_key, fair_stamp"
    };
}
macro_rules! insert_values {
    () => {
        "?, ?, ?, ?, ?, 0, ?, COALESCE(?, {now+ttl}), {now}, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?"
    };
}

pub(crate) const INSERT_HEAD: &str =
    concat!("INSERT INTO tenure_jobs (", insert_columns!(), ") VALUES");

/// A job with a dedup key: on PostgreSQL into the partition that holds the key's unique
/// index (every keyed job lives there; docs/storage-design.md, job slots).
pub(crate) const KEYED_INSERT_HEAD: &str =
    concat!("INSERT INTO {keyed_jobs} (", insert_columns!(), ") VALUES");

/// One row; one shape for both kinds of due time: an instant, or NULL and a delay.
/// A job with dependencies is inserted `blocked`, with its stripes and `run_when`.
pub(crate) const INSERT_ROW: &str = concat!("(", insert_values!(), ")");

/// [`INSERT_HEAD`] and [`INSERT_ROW`] for a multi-row insert that writes its jobs' ready
/// entries itself ([`Syntax::ready_entries`](crate::backend::Syntax::ready_entries)): the
/// ring's row trigger passes these rows by.
pub(crate) const INSERT_HEAD_WRITING_ENTRIES: &str = concat!(
    "INSERT INTO tenure_jobs (",
    insert_columns!(),
    ", ready_entry_by_insert) VALUES"
);
pub(crate) const INSERT_ROW_WRITING_ENTRIES: &str = concat!("(", insert_values!(), ", TRUE)");

/// PostgreSQL and SQLite: a job whose key a live job already has is not inserted; the live
/// job is returned instead, its `dedup_hits` counted up (so "existing" is `dedup_hits > 0`,
/// and the row comes from the upsert itself, which sees committed rows), its window the
/// larger of the two, and the mode's `{sets}` applied. Concurrent enqueues of one key wait
/// for each other on the unique index: exactly one inserts, the others update in turn. The
/// state and kind come back to say whether the mode applied (the upsert changes neither).
pub(crate) const INSERT_DEDUP_ON_CONFLICT: &str = " ON CONFLICT (queue, dedup_key) \
    WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'running') \
    DO UPDATE SET dedup_hits = tenure_jobs.dedup_hits + 1, \
    dedup_window_micros = {greatest}(\
        COALESCE(tenure_jobs.dedup_window_micros, excluded.dedup_window_micros), \
        COALESCE(excluded.dedup_window_micros, tenure_jobs.dedup_window_micros)){sets} \
    RETURNING id, dedup_hits, state, kind";

/// What a plain insert returns where the backend can: the same row as the upsert's.
pub(crate) const INSERTED_RETURNING: &str = " RETURNING id, dedup_hits, state, kind";

/// MariaDB: the unique index is on the generated `live_dedup_key`. On a duplicate the live
/// job's `dedup_hits` is counted up, and RETURNING gives the row as the upsert left it (as
/// ON CONFLICT's does). Assignments run left to right: the mode's `{sets}` read `state`,
/// which none changes.
pub(crate) const INSERT_DEDUP_ON_DUPLICATE_KEY: &str = " ON DUPLICATE KEY UPDATE {sets}\
    dedup_window_micros = GREATEST(COALESCE(dedup_window_micros, VALUES(dedup_window_micros)), \
        COALESCE(VALUES(dedup_window_micros), dedup_window_micros)), \
    dedup_hits = dedup_hits + 1 RETURNING id, dedup_hits, state, kind";

/// What a mode changes on a live duplicate, with ON CONFLICT: only a waiting job of the same
/// kind (a key shared by two kinds must never hand one kind's payload to the other's
/// handler; a duplicate of another kind is folded unchanged).
pub(crate) fn on_conflict_sets(mode: OnDuplicate) -> &'static str {
    match mode {
        OnDuplicate::Keep => "",
        OnDuplicate::Replace => {
            ", payload = CASE WHEN tenure_jobs.state = 'waiting' AND tenure_jobs.kind = excluded.kind \
                THEN excluded.payload ELSE tenure_jobs.payload END, \
             due_at = CASE WHEN tenure_jobs.state = 'waiting' AND tenure_jobs.kind = excluded.kind \
                THEN excluded.due_at ELSE tenure_jobs.due_at END"
        }
        OnDuplicate::KeepEarlierDue => {
            ", due_at = CASE WHEN tenure_jobs.state = 'waiting' AND tenure_jobs.kind = excluded.kind \
                AND excluded.due_at < tenure_jobs.due_at THEN excluded.due_at ELSE tenure_jobs.due_at END"
        }
    }
}

/// The same with ON DUPLICATE KEY UPDATE.
pub(crate) fn on_duplicate_key_sets(mode: OnDuplicate) -> &'static str {
    match mode {
        OnDuplicate::Keep => "",
        OnDuplicate::Replace => {
            "payload = IF(state = 'waiting' AND kind = VALUES(kind), VALUES(payload), payload), \
             due_at = IF(state = 'waiting' AND kind = VALUES(kind), VALUES(due_at), due_at), "
        }
        OnDuplicate::KeepEarlierDue => {
            "due_at = IF(state = 'waiting' AND kind = VALUES(kind) AND VALUES(due_at) < due_at, \
                VALUES(due_at), due_at), "
        }
    }
}

/// The newest job of the queue with the key that finished within the window (`{now+ttl}`
/// with minus the window), unless a live job other than the given id has the key (a live
/// job comes first: the upsert folds into it). A plain read: a locking one would meet the
/// finishers' and pruners' locks while it fetches rows (on MySQL/MariaDB a deadlock reported
/// mid-fetch left the client waiting for rows that never came); the fold below re-checks.
pub(crate) const FIND_FINISHED_TWIN: &str = "SELECT id FROM tenure_jobs \
    WHERE queue = ? AND dedup_key = ? AND state IN {final_states} AND finished_at > {now+ttl} \
    AND NOT EXISTS (SELECT 1 FROM tenure_jobs live WHERE live.queue = ? AND live.dedup_key = ? \
        AND live.state IN ('waiting', 'running') AND live.id <> ?) \
    ORDER BY finished_at DESC, id DESC LIMIT 1";

/// Folds an enqueue into the finished twin found, if it still is one within the window (a
/// prune or a retry may have come between): counted, and kept by retention for the larger
/// of the two windows. One row changed, or none (then there is no twin to fold into). By
/// primary key, with the checks on the row it locks.
pub(crate) const FOLD_FINISHED: &str = "UPDATE tenure_jobs SET dedup_hits = dedup_hits + 1, \
    dedup_window_micros = {greatest}(COALESCE(dedup_window_micros, ?), ?) \
    WHERE id = ? AND state IN {final_states} AND finished_at > {now+ttl}";

/// Binds one [`INSERT_ROW`] for `job` onto `$start` (a statement, or a row of a multi-row
/// one): every insert of a job binds the same values in the same order.
macro_rules! job_row {
    ($start:expr, $job:expr) => {{
        let job: &NewJob = $job;
        let (at, delay) = job.due_params();
        let (state, run_when, stripes) = job.dependency_params();
        $start
            .bind::<Text, _>(job.queue.as_str())
            .bind::<Text, _>(job.kind.as_str())
            .bind::<Binary, _>(job.payload.as_slice())
            .bind::<Integer, _>(job.priority)
            .bind::<Text, _>(state)
            .bind::<Integer, _>(job.max_attempts as i32)
            .bind::<Nullable<Instant>, _>(at)
            .bind::<BigInt, _>(delay)
            .bind::<Nullable<Text>, _>(job.dedup_key.as_deref())
            .bind::<Nullable<Text>, _>(job.first_limit().0)
            .bind::<Nullable<Integer>, _>(job.first_limit().1)
            .bind::<Nullable<BigInt>, _>(job.window_micros())
            .bind::<Nullable<BigInt>, _>(job.workflow_id)
            .bind::<Nullable<Text>, _>(run_when)
            .bind::<Nullable<Integer>, _>(stripes)
            .bind::<Nullable<Text>, _>(job.sequence_key())
            .bind::<Nullable<Text>, _>(job.fair_key.as_deref())
            .bind::<BigInt, _>(job.fair_stamp)
    }};
}

/// Inserts one validated job on a concrete connection (or finds the live job with its dedup
/// key, applying the job's [`OnDuplicate`] mode to it) and evaluates to
/// `QueryResult<Enqueued>`: one statement, whose RETURNING gives the row's id, hits, state
/// and kind (every backend has INSERT ... RETURNING, MariaDB's upsert included: it returns
/// the row as the upsert left it).
macro_rules! insert_one {
    ($c:ident, $job:expr, $notify_inline:expr) => {{
        let job: &NewJob = $job;
        let syntax = $c.syntax();
        // Only a keyed job can meet a twin: a plain one is a plain insert (the upsert's
        // arbiter check and, on MySQL, its locks cost concurrent enqueuers).
        let (tail, sets) = match (job.dedup_key.is_some(), syntax.upsert) {
            (true, Upsert::OnConflictWhere) => {
                (INSERT_DEDUP_ON_CONFLICT, on_conflict_sets(job.on_duplicate))
            }
            (true, Upsert::OnDuplicateKey) => (
                INSERT_DEDUP_ON_DUPLICATE_KEY,
                on_duplicate_key_sets(job.on_duplicate),
            ),
            (false, _) => (INSERTED_RETURNING, ""),
        };
        let notify = if $notify_inline {
            syntax.notify_in_returning
        } else {
            ""
        };
        let head = if job.dedup_key.is_some() {
            KEYED_INSERT_HEAD
        } else {
            INSERT_HEAD
        };
        let sql = syntax.render_with(
            "{head} {row}{tail}{notify}",
            &[
                ("head", head),
                ("row", INSERT_ROW),
                ("tail", tail),
                ("sets", sets),
                ("notify", notify),
            ],
        );
        let moded = job.on_duplicate != OnDuplicate::Keep;
        job_row!(statement(sql), job)
            .get_result::<InsertedRow>($c)
            .map(|row| {
                let existing = row.dedup_hits > 0 && job.dedup_key.is_some();
                Enqueued {
                    id: row.id,
                    existing,
                    updated: existing && moded && row.state == "waiting" && row.kind == job.kind,
                }
            })
    }};
}

/// Evaluates to `QueryResult<Option<Enqueued>>`: the job folded into a twin of its key that
/// finished within its window (`None`: there is none, or a live job other than `$new_id`
/// has the key). Inside the enqueue's transaction.
macro_rules! fold_into_finished_twin {
    ($c:ident, $job:expr, $new_id:expr) => {{
        let job: &NewJob = $job;
        match (
            job.dedup_key.as_deref(),
            job.dedup_window,
            job.window_micros(),
        ) {
            (Some(key), Some((_, over)), Some(window)) => {
                let states = match over {
                    DedupOver::Completed => "('completed')",
                    DedupOver::AnyFinal => "('completed', 'dead', 'cancelled')",
                };
                let find = $c
                    .syntax()
                    .render_with(FIND_FINISHED_TWIN, &[("final_states", states)]);
                statement(find)
                    .bind::<Text, _>(&job.queue)
                    .bind::<Text, _>(key)
                    .bind::<BigInt, _>(-window)
                    .bind::<Text, _>(&job.queue)
                    .bind::<Text, _>(key)
                    .bind::<BigInt, _>($new_id)
                    .get_result::<IdRow>($c)
                    .optional()
                    .and_then(|twin| match twin {
                        None => Ok(None),
                        Some(twin) => {
                            let fold = $c
                                .syntax()
                                .render_with(FOLD_FINISHED, &[("final_states", states)]);
                            statement(fold)
                                .bind::<BigInt, _>(window)
                                .bind::<BigInt, _>(window)
                                .bind::<BigInt, _>(twin.id)
                                .bind::<BigInt, _>(-window)
                                .execute($c)
                                .map(|changed| {
                                    (changed == 1).then_some(Enqueued {
                                        id: twin.id,
                                        existing: true,
                                        updated: false,
                                    })
                                })
                        }
                    })
            }
            _ => Ok(None),
        }
    }};
}

/// Enqueues one validated job, its dedup window included, and evaluates to
/// `QueryResult<Enqueued>`; in a transaction when the job has a window.
///
/// The window over finished jobs is not the unique index's (that is over live jobs only), so
/// it is checked twice: before the insert (the common case: the twin finished a while ago,
/// and nothing is inserted), and, when the insert made a new job, again after it. A twin
/// that finished between the first check and the insert was live when the insert began or
/// finished before it: live, it conflicted on the unique index (the insert waited for its
/// finish, or folded into it); finished, the second check sees it (READ COMMITTED: each
/// statement sees what committed before it began), and the new job, which nobody has seen
/// since the transaction has not committed, is deleted. So two jobs of one key never both
/// stand inside a window.
macro_rules! insert_deduplicated {
    ($c:ident, $job:expr, $notify_inline:expr) => {{
        let job: &NewJob = $job;
        'done: {
            if job.dedup_window.is_none() {
                break 'done insert_one!($c, job, $notify_inline);
            }
            match fold_into_finished_twin!($c, job, -1i64) {
                Ok(Some(twin)) => break 'done Ok(twin),
                Ok(None) => {}
                Err(e) => break 'done Err(e),
            }
            let new = match insert_one!($c, job, $notify_inline) {
                Ok(new) if !new.existing => new,
                other => break 'done other,
            };
            match fold_into_finished_twin!($c, job, new.id) {
                Ok(Some(twin)) => statement("DELETE FROM tenure_jobs WHERE id = ?")
                    .bind::<BigInt, _>(new.id)
                    .execute($c)
                    .map(|_| twin),
                Ok(None) => Ok(new),
                Err(e) => Err(e),
            }
        }
    }};
}
pub(crate) use {fold_into_finished_twin, insert_deduplicated, insert_one, job_row};

/// Locks the dependencies of every job of a batch at once, in ascending id order (one
/// order for every locker: two enqueues, or an enqueue and a finish, never wait for each
/// other in a cycle), so none finishes unseen until the enqueue commits; refuses a missing
/// one.
pub(crate) fn lock_dependencies<'j, C: TenureConnection>(
    conn: &mut C,
    jobs: impl IntoIterator<Item = &'j NewJob>,
) -> Result<HashMap<i64, dependencies::Dependency>> {
    let mut ids: Vec<i64> = jobs
        .into_iter()
        .flat_map(|j| j.dependencies.iter().copied())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    Ok(dependencies::lock(conn, &ids)?
        .into_iter()
        .map(|d| (d.id, d))
        .collect())
}

/// Inserts one validated job with dependencies, in the enqueue's transaction, its
/// dependencies locked ([`lock_dependencies`]): inserts it `blocked` in the workflow given
/// or its first dependency's, writes its limits and dependencies, and settles those
/// already finished (it may leave `blocked` at once).
pub(crate) fn insert_dependent<C: TenureConnection>(
    conn: &mut C,
    job: &NewJob,
    locked: &HashMap<i64, dependencies::Dependency>,
) -> Result<Enqueued> {
    let deps: Vec<&dependencies::Dependency> = job
        .dependencies
        .iter()
        .filter_map(|id| locked.get(id))
        .collect();
    let inherited: NewJob;
    let job = match (job.workflow_id, deps.iter().find_map(|d| d.workflow_id)) {
        (None, Some(workflow)) => {
            inherited = NewJob {
                workflow_id: Some(workflow),
                ..job.clone()
            };
            &inherited
        }
        _ => job,
    };
    let enqueued = dispatch!(conn, c => insert_one!(c, job, false))?;
    if !job.limits.is_empty() {
        limits::record(conn, &[(enqueued.id, &job.limits)])?;
    }
    dependencies::record(conn, enqueued.id, job.run_when.as_str(), &deps)?;
    Ok(enqueued)
}

/// Inserts one validated job of a sequence ([`NewJob::sequence`]), in the enqueue's
/// transaction: locks its key's row, waits (blocked, by a dependency edge) for the last job
/// of the key unless that one completed, was pruned, or ended otherwise with the sequence
/// going on, and records the new job as the key's last. The edge does not make the job join
/// its predecessor's workflow.
pub(crate) fn insert_in_sequence<C: TenureConnection>(
    conn: &mut C,
    job: &NewJob,
) -> Result<Enqueued> {
    let Some((key, failure)) = job.sequence.as_ref() else {
        return Err(unexpected(
            "a job without a sequence key given as one".into(),
        ));
    };
    let hold = *failure == SequenceFailure::Hold;
    let predecessor = match sequences::lock_last(conn, key)? {
        Some(last) => dependencies::lock_existing(conn, last)?,
        None => None,
    };
    let waits_for = predecessor.filter(|p| match p.state.as_str() {
        "completed" => false,
        "dead" | "cancelled" => hold,
        _ => true,
    });
    let enqueued = match waits_for {
        Some(predecessor) => {
            let (run_when, edge) = if hold {
                (RunWhen::AllCompleted, sequences::SEQUENCE_HOLD)
            } else {
                (RunWhen::AllFinished, sequences::SEQUENCE_CONTINUE)
            };
            let chained = NewJob {
                dependencies: vec![predecessor.id],
                run_when,
                ..job.clone()
            };
            let enqueued = dispatch!(conn, c => insert_one!(c, &chained, false))?;
            if !job.limits.is_empty() {
                limits::record(conn, &[(enqueued.id, &job.limits)])?;
            }
            dependencies::record(conn, enqueued.id, edge, &[&predecessor])?;
            enqueued
        }
        None => {
            let enqueued = dispatch!(conn, c => insert_one!(c, job, false))?;
            if !job.limits.is_empty() {
                limits::record(conn, &[(enqueued.id, &job.limits)])?;
            }
            enqueued
        }
    };
    sequences::advance(conn, key, enqueued.id)?;
    Ok(enqueued)
}

/// Whether an enqueue of this job needs a transaction of its own: a window's checks and
/// insert go together; a job and its limits commit together (a job must never be claimable
/// without the limits that hold it back); a fair job's stamp and its tenant's last go
/// together.
fn needs_transaction(job: &NewJob) -> bool {
    job.dedup_window.is_some()
        || job.fair_key.is_some()
        || !job.dependencies.is_empty()
        || !job.limits.is_empty()
}

/// Enqueues one job on `conn`, inside the caller's transaction if there is one (so a
/// rolled-back transaction leaves no job). With a dedup key that a live job of the queue
/// already has, no job is made and that job's id comes back, marked
/// [`existing`](Enqueued::existing) (and changed as [`NewJob::on_duplicate`] says); with a
/// [`dedup window`](NewJob::dedup_window), the same for a job of the key that finished
/// within it.
pub fn enqueue<C: TenureConnection>(conn: &mut C, job: &NewJob) -> Result<Enqueued> {
    job.validate()?;
    // Other processes' idle workers are woken by a NOTIFY: in the insert's RETURNING list
    // inside a caller's transaction (delivered if it commits), else after the commit.
    let inline = in_transaction(conn);
    let enqueued = if job.sequence.is_some() || needs_transaction(job) {
        retrying_transaction(conn, |conn| {
            // A fair job takes its tenant's next stamp first (its row's lock is taken before
            // any other: one order for every enqueue).
            let stamped = fairness::stamped(conn, std::slice::from_ref(job))?;
            let job = &stamped[0];
            if job.sequence.is_some() {
                let enqueued = insert_in_sequence(conn, job)?;
                if inline {
                    wake::notify(conn, [job.queue.as_str()])?;
                }
                return Ok(enqueued);
            }
            if !job.dependencies.is_empty() {
                let locked = lock_dependencies(conn, std::slice::from_ref(job))?;
                let enqueued = insert_dependent(conn, job, &locked)?;
                if inline {
                    wake::notify(conn, [job.queue.as_str()])?;
                }
                return Ok(enqueued);
            }
            let enqueued = dispatch!(conn, c => insert_deduplicated!(c, job, inline))?;
            if !enqueued.existing && !job.limits.is_empty() {
                limits::record(conn, &[(enqueued.id, &job.limits)])?;
            }
            Ok::<_, Error>(enqueued)
        })?
    } else {
        // SQLite: this process's writers take turns (see `tenure::transaction`); the insert is
        // one statement, so the turn is held only around it.
        let insert = |conn: &mut C| -> Result<Enqueued> {
            let _turn = write_turn(conn)?;
            Ok(dispatch!(conn, c => insert_one!(c, job, inline))?)
        };
        if inline {
            // A deadlock ends the caller's transaction: theirs to run again.
            insert(conn)?
        } else {
            // On its own, a statement a deadlock rolled back (MariaDB: its ring trigger's
            // entry against a claim's or a rotation's) is run again, as a transaction is.
            retry_transient(|| insert(conn))?
        }
    };
    let fresh = !enqueued.existing || enqueued.updated;
    if fresh && !inline {
        wake::notify_committed(conn, [job.queue.as_str()]);
    }
    wake::wake([job.queue.as_str()]);
    #[cfg(feature = "metrics")]
    if !enqueued.existing {
        count_enqueued(&job.queue, 1);
    }
    Ok(enqueued)
}

pub(crate) fn unexpected(message: String) -> Error {
    Error::Database(diesel::result::Error::DeserializationError(message.into()))
}

/// Counts enqueued jobs of `queue` (`tenure_jobs_enqueued_total`, see [`crate::metrics`]).
#[cfg(feature = "metrics")]
pub(crate) fn count_enqueued(queue: &str, n: usize) {
    metrics::counter!("tenure_jobs_enqueued_total", "queue" => queue.to_string())
        .increment(n as u64);
}

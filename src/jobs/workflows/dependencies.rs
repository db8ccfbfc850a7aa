//! Dependencies: a job that waits for other jobs ([`crate::jobs::NewJob::depends_on`]), and its
//! release in the transaction that finishes the last of them.
//!
//! A dependent job is `blocked`. Its dependencies still pending are counted in *stripes*
//! (`tenure_dependency_stripes`, about [`STRIPE_SIZE`] dependencies each, at most
//! [`MAX_STRIPES`]), and the job's row counts its stripes still pending
//! (`stripes_pending`). Finishing a dependency decrements its stripe; only the finish that
//! empties a stripe decrements the job's row, and the one that brings that to zero decides
//! the job (releases it, or cancels it). Every count is an `UPDATE` of the row it changes,
//! which takes the row's lock and works on its latest committed value, so two finishes at
//! the same instant are ordered by the row and exactly one of them sees zero: no lost
//! release, no double release, whatever the isolation level. A fan-in of 1,000 finishes
//! spreads over its stripes, and the job's own row is written once per stripe, not once per
//! dependency.
//!
//! Locks are taken in one order: the finishing jobs' rows, then per dependent (ascending id)
//! its stripes (ascending), then its row. A dependent's id is always larger than its
//! dependencies' (they exist before it is inserted), so a job's row is locked as a finishing
//! job before, never after, the rows of the jobs that wait for it.

use std::collections::{BTreeMap, HashMap};

use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::prelude::*;
use diesel::serialize::{self, Output, ToSql};
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::jobs::flow::sequences::{SEQUENCE_CONTINUE, SEQUENCE_HOLD};
use crate::jobs::{JobState, MAX_BATCH};
use crate::rows::{IdStateRow, NullableInt, QueueRow};
use crate::schema::{tenure_dependency_stripes, tenure_job_dependencies};
use crate::{Error, Result, TenureConnection};

/// When a job with dependencies runs, and what becomes of it otherwise.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, JobState, NewJob, RunWhen};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let fetch = jobs::enqueue(&mut conn, &NewJob::new("etl", "fetch", vec![]))?.id;
/// let report = NewJob::new("etl", "report", vec![]).depends_on([fetch]).run_when(RunWhen::AllFinished);
/// let report = jobs::enqueue(&mut conn, &report)?.id;
/// assert_eq!(jobs::get(&mut conn, report)?.unwrap().state, JobState::Blocked);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
pub enum RunWhen {
    /// When every dependency completed; cancelled as soon as one dies or is cancelled (the
    /// default: "run C after A and B succeed").
    #[default]
    AllCompleted,
    /// When every dependency finished, however (completed, dead or cancelled).
    AllFinished,
    /// As soon as one dependency dies or is cancelled; cancelled if they all complete.
    AnyFailed,
}

impl RunWhen {
    /// As stored: `all_completed`, `all_finished` or `any_failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunWhen::AllCompleted => "all_completed",
            RunWhen::AllFinished => "all_finished",
            RunWhen::AnyFailed => "any_failed",
        }
    }

    fn parse(text: &str) -> Result<RunWhen> {
        match text {
            "all_completed" => Ok(RunWhen::AllCompleted),
            "all_finished" => Ok(RunWhen::AllFinished),
            "any_failed" => Ok(RunWhen::AnyFailed),
            other => Err(Error::Database(
                diesel::result::Error::DeserializationError(
                    format!("unknown run_when {other:?}").into(),
                ),
            )),
        }
    }
}

impl<DB: diesel::backend::Backend> FromSql<Text, DB> for RunWhen
where
    String: FromSql<Text, DB>,
{
    fn from_sql(bytes: DB::RawValue<'_>) -> deserialize::Result<Self> {
        let text = <String as FromSql<Text, DB>>::from_sql(bytes)?;
        RunWhen::parse(&text).map_err(|e| e.to_string().into())
    }
}

impl<DB: diesel::backend::Backend> ToSql<Text, DB> for RunWhen
where
    str: ToSql<Text, DB>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
        <str as ToSql<Text, DB>>::to_sql(self.as_str(), out)
    }
}

/// The most jobs one job may depend on.
pub const MAX_DEPENDENCIES: usize = 100_000;
/// About this many pending dependencies share a stripe.
pub(crate) const STRIPE_SIZE: usize = 16;
/// The most stripes a job's dependencies are spread over. Measured (BENCHMARKS.md,
/// "Workflows"): 8 spread eight concurrent completers as well as 64 did, while a worker's
/// batched completions touch at most 8 stripe rows per dependent instead of up to 64.
pub(crate) const MAX_STRIPES: usize = 8;

/// How many stripes `n` dependencies are spread over.
pub(crate) fn stripes_for(n: usize) -> i32 {
    n.div_ceil(STRIPE_SIZE).clamp(1, MAX_STRIPES) as i32
}

/// Locks the dependencies (ascending, by primary key) and reads them: their state and
/// workflow. Missing ones are [`Error::InvalidInput`]. Holding their locks until the enqueue
/// commits, a dependency cannot finish unseen: its finish waits, then finds the new edges.
const LOCK_DEPENDENCIES: &str =
    "SELECT id, state, workflow_id FROM tenure_jobs WHERE id IN {ids} ORDER BY id{for_update}";

/// Counts a new dependent on each locked dependency: finishing it then looks for dependents.
/// Every such enqueue writes the dependency's row, so on PostgreSQL a finish in an older
/// REPEATABLE READ snapshot (a caller's transaction) fails with a serialization error when
/// it locks the row, rather than miss a dependent it cannot see.
const COUNT_DEPENDENT: &str =
    "UPDATE tenure_jobs SET dependents = dependents + 1 WHERE id IN {ids}";

/// A dependency as locked.
#[derive(QueryableByName)]
pub(crate) struct Dependency {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub workflow_id: Option<i64>,
}

/// Locks and reads the dependencies `ids` (sorted, no repeats): refuses a missing one.
pub(crate) fn lock<C: TenureConnection>(conn: &mut C, ids: &[i64]) -> Result<Vec<Dependency>> {
    let mut found = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(MAX_BATCH) {
        let rows: Vec<Dependency> = dispatch!(conn, c => {
            statement(c.syntax().render(LOCK_DEPENDENCIES))
                .bind_ids(chunk.iter().copied())
                .load::<Dependency>(c)
        })?;
        if rows.len() != chunk.len() {
            let have: std::collections::HashSet<i64> = rows.iter().map(|r| r.id).collect();
            let missing = chunk
                .iter()
                .find(|id| !have.contains(id))
                .copied()
                .unwrap_or(0);
            return Err(Error::invalid(
                "dependencies",
                format!("there is no job {missing} (a job may depend only on jobs that exist)"),
            ));
        }
        found.extend(rows);
    }
    found.sort_by_key(|d| d.id);
    Ok(found)
}

/// Records the dependencies of a job just inserted `blocked` with
/// `stripes_pending = stripes_for(deps.len())`, and settles at once those already finished
/// (the job may be released or cancelled before the enqueue returns). In the enqueue's
/// transaction, holding the dependencies' locks ([`lock`]).
pub(crate) fn record<C: TenureConnection>(
    conn: &mut C,
    job_id: i64,
    run_when: &str,
    deps: &[&Dependency],
) -> Result<Vec<String>> {
    let stripes = stripes_for(deps.len());
    let mut pending = vec![0i32; stripes as usize];
    let edges: Vec<_> = deps
        .iter()
        .enumerate()
        .map(|(i, dep)| {
            let stripe = (i % stripes as usize) as i32;
            pending[stripe as usize] += 1;
            (
                tenure_job_dependencies::job_id.eq(job_id),
                tenure_job_dependencies::depends_on.eq(dep.id),
                tenure_job_dependencies::stripe.eq(stripe),
                tenure_job_dependencies::run_when.eq(run_when),
            )
        })
        .collect();
    let stripe_rows: Vec<_> = pending
        .iter()
        .enumerate()
        .map(|(stripe, n)| {
            (
                tenure_dependency_stripes::job_id.eq(job_id),
                tenure_dependency_stripes::stripe.eq(stripe as i32),
                tenure_dependency_stripes::pending.eq(*n),
            )
        })
        .collect();
    dispatch!(conn, c => {
        for chunk in edges.chunks(MAX_BATCH) {
            diesel::insert_into(tenure_job_dependencies::table).values(chunk).execute(c)?;
        }
        diesel::insert_into(tenure_dependency_stripes::table).values(&stripe_rows).execute(c)?;
        for chunk in deps.chunks(MAX_BATCH) {
            statement(COUNT_DEPENDENT).bind_ids(chunk.iter().map(|d| d.id)).execute(c)?;
        }
        Ok::<(), Error>(())
    })?;
    let mut finished = Vec::new();
    for dep in deps {
        let state = JobState::parse(&dep.state)?;
        if state.is_final() {
            finished.push((dep.id, state));
        }
    }
    settle(conn, finished)
}

/// An edge not yet counted, with what its dependent decides on.
#[derive(QueryableByName)]
pub(super) struct PendingEdge {
    #[diesel(sql_type = BigInt)]
    pub(super) job_id: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) depends_on: i64,
    #[diesel(sql_type = Integer)]
    pub(super) stripe: i32,
    #[diesel(sql_type = Text)]
    pub(super) run_when: String,
}

/// The edges of finishing jobs not yet counted. A locking read: it sees the latest
/// committed edges whatever the caller's isolation (edges are written only under the lock
/// of the job they point to, which the finishing transaction holds).
const PENDING_EDGES: &str = "\
    SELECT job_id, depends_on, stripe, run_when FROM tenure_job_dependencies \
    WHERE counted = 0 AND depends_on IN {ids}{for_update}";

/// The writes of a settle change rows only inside its transaction (`{in_transaction}`, MySQL;
/// see `COMPLETE` in `jobs/queue/finish.rs`): edges counted in autocommit after a Galera node
/// rolled the completion back were never counted again, and their dependent stayed blocked.
/// Each write checks it changed what it locked.
const COUNT_EDGES: &str = "\
    UPDATE tenure_job_dependencies SET counted = 1 WHERE counted = 0 AND depends_on IN {ids}\
    {in_transaction}";

/// The dependents' states, a plain read (no lock, so no lock order to keep): one seen
/// finished, waiting or running is never blocked again, and is left alone; one not seen
/// (an older snapshot) or seen blocked is counted down under its rows' locks.
const DEPENDENT_STATES: &str = "SELECT id, state FROM tenure_jobs WHERE id IN {ids}";

const DECREMENT_STRIPE: &str = "\
    UPDATE tenure_dependency_stripes SET pending = pending - ? WHERE job_id = ? AND stripe = ?\
    {in_transaction}";
const DECREMENT_STRIPE_RETURNING: &str = "\
    UPDATE tenure_dependency_stripes SET pending = pending - ? WHERE job_id = ? AND stripe = ? \
    RETURNING pending AS n";
const DECREMENT_STRIPES_PENDING_RETURNING: &str = "\
    UPDATE tenure_jobs SET stripes_pending = stripes_pending - ? WHERE id = ? \
    RETURNING stripes_pending AS n";
const STRIPE_PENDING: &str =
    "SELECT pending AS n FROM tenure_dependency_stripes WHERE job_id = ? AND stripe = ?";

const DECREMENT_STRIPES_PENDING: &str =
    "UPDATE tenure_jobs SET stripes_pending = stripes_pending - ? WHERE id = ?{in_transaction}";
/// Read after this transaction's own update of the row: its latest version, at any
/// isolation.
const STRIPES_PENDING: &str = "SELECT stripes_pending AS n FROM tenure_jobs WHERE id = ?";

/// A held sequence's edge whose predecessor died or was cancelled: pending again.
const UNCOUNT_HELD_EDGE: &str = "\
    UPDATE tenure_job_dependencies SET counted = 0 WHERE job_id = ? AND depends_on = ?\
    {in_transaction}";

/// A blocked job runs: waiting, due when it was due (a delayed job keeps its delay).
const RELEASE: &str =
    "UPDATE tenure_jobs SET state = 'waiting' WHERE id = ? AND state = 'blocked'{in_transaction}";
/// The queue of a job this transaction just released (its own write: visible at any
/// isolation).
const QUEUE_OF: &str = "SELECT queue FROM tenure_jobs WHERE id = ?";

/// A blocked job will never run: cancelled, saying why.
const CANCEL_BLOCKED: &str = "\
    UPDATE tenure_jobs SET state = 'cancelled', finished_at = {now}, last_error = ? \
    WHERE id = ? AND state = 'blocked'{in_transaction}";

/// Settles the dependents of jobs that just finished (`finished`: id and final state), in
/// the transaction that finished them, which holds their rows' locks: counts each uncounted
/// edge once, releases the dependents whose condition is met and cancels those whose
/// condition can no longer be, and settles in turn the dependents of those it cancels.
/// Returns the queues of the jobs it released (to wake their workers).
pub(crate) fn settle<C: TenureConnection>(
    conn: &mut C,
    mut finished: Vec<(i64, JobState)>,
) -> Result<Vec<String>> {
    let mut released_queues = Vec::new();
    while !finished.is_empty() {
        finished.sort_unstable_by_key(|(id, _)| *id);
        let state_of: HashMap<i64, JobState> = finished.iter().copied().collect();
        let mut edges: Vec<PendingEdge> = Vec::new();
        for chunk in finished.chunks(MAX_BATCH) {
            let ids = || chunk.iter().map(|(id, _)| *id);
            let before = edges.len();
            dispatch!(conn, c => {
                edges.extend(
                    statement(c.syntax().render(PENDING_EDGES))
                        .bind_ids(ids())
                        .load::<PendingEdge>(c)?,
                );
                let found = edges.len() - before;
                if statement(c.syntax().render(COUNT_EDGES)).bind_ids(ids()).execute(c)? != found {
                    return Err(Error::RolledBackUnderUs { operation: "settling dependents" });
                }
                Ok::<(), Error>(())
            })?;
        }
        finished.clear();
        // A held sequence's edge counts only its predecessor's completion: a death or a
        // cancel leaves it pending (uncounted again), for a retried run's completion or an
        // operator's `skip_in_sequence`.
        let (held, counting): (Vec<PendingEdge>, Vec<PendingEdge>) =
            edges.into_iter().partition(|e| {
                e.run_when == SEQUENCE_HOLD
                    && state_of.get(&e.depends_on) != Some(&JobState::Completed)
            });
        for edge in held {
            dispatch!(conn, c => {
                statement(c.syntax().render(UNCOUNT_HELD_EDGE))
                    .bind::<BigInt, _>(edge.job_id)
                    .bind::<BigInt, _>(edge.depends_on)
                    .execute(c)
            })?;
        }
        let edges = counting;
        if edges.is_empty() {
            break;
        }
        // Per dependent: its RunWhen, the failed dependencies, and per stripe the
        // dependencies that count as done.
        #[derive(Default)]
        struct Tally {
            run_when: String,
            failed: Vec<i64>,
            done: BTreeMap<i32, i32>,
        }
        let mut by_dependent: BTreeMap<i64, Tally> = BTreeMap::new();
        for edge in edges {
            let tally = by_dependent.entry(edge.job_id).or_default();
            tally.run_when = edge.run_when;
            let completed = state_of.get(&edge.depends_on) == Some(&JobState::Completed);
            if !completed {
                tally.failed.push(edge.depends_on);
            }
            if completed
                || tally.run_when == RunWhen::AllFinished.as_str()
                || tally.run_when == SEQUENCE_CONTINUE
            {
                *tally.done.entry(edge.stripe).or_default() += 1;
            }
        }
        let ids: Vec<i64> = by_dependent.keys().copied().collect();
        let mut settled: HashMap<i64, bool> = HashMap::new();
        for chunk in ids.chunks(MAX_BATCH) {
            let rows: Vec<IdStateRow> = dispatch!(conn, c => {
                statement(DEPENDENT_STATES).bind_ids(chunk.iter().copied()).load::<IdStateRow>(c)
            })?;
            for row in rows {
                settled.insert(row.id, row.state != JobState::Blocked.as_str());
            }
        }
        for (id, tally) in by_dependent {
            if settled.get(&id) == Some(&true) {
                continue;
            }
            let run_when = match tally.run_when.as_str() {
                SEQUENCE_HOLD => RunWhen::AllCompleted,
                SEQUENCE_CONTINUE => RunWhen::AllFinished,
                other => RunWhen::parse(other)?,
            };
            if let Some(first) = tally.failed.first() {
                match run_when {
                    RunWhen::AllCompleted => {
                        let why = format!("a dependency (job {first}) did not complete");
                        if cancel_blocked(conn, id, &why)? {
                            finished.push((id, JobState::Cancelled));
                        }
                        continue;
                    }
                    RunWhen::AnyFailed => {
                        released_queues.extend(release(conn, id)?);
                        continue;
                    }
                    RunWhen::AllFinished => {}
                }
            }
            if !count_down(conn, id, &tally.done)? {
                continue;
            }
            match run_when {
                RunWhen::AllCompleted | RunWhen::AllFinished => {
                    released_queues.extend(release(conn, id)?);
                }
                RunWhen::AnyFailed => {
                    if cancel_blocked(conn, id, "no dependency failed")? {
                        finished.push((id, JobState::Cancelled));
                    }
                }
            }
        }
    }
    released_queues.sort_unstable();
    released_queues.dedup();
    crate::wake::notify(conn, released_queues.iter().map(String::as_str))?;
    Ok(released_queues)
}

/// Counts dependencies down in their stripes (ascending), then the emptied stripes down on
/// the job's row. True if this brought the job's row to zero: every dependency is counted,
/// and this transaction (holding the row's lock) decides the job.
pub(super) fn count_down<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    done: &BTreeMap<i32, i32>,
) -> Result<bool> {
    dispatch!(conn, c => {
        // With RETURNING, the count left comes back from the update itself; MySQL reads it
        // after (its own write: the latest version).
        let returning = c.syntax().returning;
        let mut emptied = 0;
        for (stripe, n) in done {
            let decrement = statement(if returning { DECREMENT_STRIPE_RETURNING } else { c.syntax().render(DECREMENT_STRIPE) })
                .bind::<Integer, _>(*n)
                .bind::<BigInt, _>(id)
                .bind::<Integer, _>(*stripe);
            let left = if returning {
                decrement.get_result::<NullableInt>(c).optional()?
            } else {
                if decrement.execute(c)? != 1 {
                    return Err(Error::RolledBackUnderUs { operation: "settling dependents" });
                }
                statement(STRIPE_PENDING)
                    .bind::<BigInt, _>(id)
                    .bind::<Integer, _>(*stripe)
                    .get_result::<NullableInt>(c)
                    .optional()?
            };
            if left.and_then(|l| l.n) == Some(0) {
                emptied += 1;
            }
        }
        if emptied == 0 {
            return Ok(false);
        }
        let decrement = statement(if returning { DECREMENT_STRIPES_PENDING_RETURNING } else { c.syntax().render(DECREMENT_STRIPES_PENDING) })
            .bind::<Integer, _>(emptied)
            .bind::<BigInt, _>(id);
        let left = if returning {
            decrement.get_result::<NullableInt>(c).optional()?
        } else {
            if decrement.execute(c)? != 1 {
                return Err(Error::RolledBackUnderUs { operation: "settling dependents" });
            }
            statement(STRIPES_PENDING)
                .bind::<BigInt, _>(id)
                .get_result::<NullableInt>(c)
                .optional()?
        };
        Ok::<bool, Error>(left.and_then(|l| l.n) == Some(0))
    })
}

/// Releases a blocked job; its queue if it did.
pub(super) fn release<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<String>> {
    dispatch!(conn, c => {
        if statement(c.syntax().render(RELEASE)).bind::<BigInt, _>(id).execute(c)? != 1 {
            // Not blocked any more, or (MySQL) the transaction is gone.
            if c.transaction_ended_under_us() {
                return Err(Error::RolledBackUnderUs { operation: "settling dependents" });
            }
            return Ok(None);
        }
        let row = statement(QUEUE_OF).bind::<BigInt, _>(id).get_result::<QueueRow>(c)?;
        Ok::<_, Error>(Some(row.queue))
    })
}

fn cancel_blocked<C: TenureConnection>(conn: &mut C, id: i64, why: &str) -> Result<bool> {
    dispatch!(conn, c => {
        let changed = statement(c.syntax().render(CANCEL_BLOCKED))
            .bind::<Text, _>(why)
            .bind::<BigInt, _>(id)
            .execute(c)?;
        // Not blocked any more, or (MySQL) the transaction is gone.
        if changed != 1 && c.transaction_ended_under_us() {
            return Err(Error::RolledBackUnderUs { operation: "settling dependents" });
        }
        Ok::<bool, Error>(changed == 1)
    })
}

/// Locks and reads the job `id` as a dependency; `None` if there is none (pruned).
pub(crate) fn lock_existing<C: TenureConnection>(
    conn: &mut C,
    id: i64,
) -> Result<Option<Dependency>> {
    Ok(dispatch!(conn, c => {
        statement(c.syntax().render(LOCK_DEPENDENCIES))
            .bind_ids([id])
            .load::<Dependency>(c)
    })?
    .pop())
}

/// The edges of retried jobs (dead again waiting) to dependents still blocked: counted
/// again, so that the dependent waits for the retried run ([`RunWhen::AllFinished`] counted
/// the death as finished; no other blocked dependent has counted it).
const REARM_EDGES: &str = "\
    SELECT d.job_id, d.depends_on, d.stripe, d.run_when FROM tenure_job_dependencies d \
    JOIN tenure_jobs w ON w.id = d.job_id \
    WHERE d.counted = 1 AND w.state = 'blocked' AND d.depends_on IN {ids}";
const UNCOUNT_EDGE: &str =
    "UPDATE tenure_job_dependencies SET counted = 0 WHERE job_id = ? AND depends_on = ?";
const INCREMENT_STRIPE: &str = "\
    UPDATE tenure_dependency_stripes SET pending = pending + 1 WHERE job_id = ? AND stripe = ?";
const INCREMENT_STRIPES_PENDING: &str = "UPDATE tenure_jobs SET stripes_pending = stripes_pending + ? WHERE id = ? AND state = 'blocked'";

/// After dead jobs (`ids`, locked by the caller and now waiting again) were retried: the
/// blocked jobs that counted their deaths wait for them again. In the retry's transaction.
pub(crate) fn rearm<C: TenureConnection>(conn: &mut C, ids: &[i64]) -> Result<()> {
    for chunk in ids.chunks(MAX_BATCH) {
        dispatch!(conn, c => {
            let mut edges = statement(REARM_EDGES)
                .bind_ids(chunk.iter().copied())
                .load::<PendingEdge>(c)?;
            // Per dependent, as `count_down` locks: its stripes in ascending order, then its
            // row once (the stripes that went from empty to pending).
            edges.sort_by_key(|e| (e.job_id, e.stripe));
            let mut refilled: BTreeMap<i64, i32> = BTreeMap::new();
            for edge in &edges {
                statement(UNCOUNT_EDGE)
                    .bind::<BigInt, _>(edge.job_id)
                    .bind::<BigInt, _>(edge.depends_on)
                    .execute(c)?;
                statement(INCREMENT_STRIPE)
                    .bind::<BigInt, _>(edge.job_id)
                    .bind::<Integer, _>(edge.stripe)
                    .execute(c)?;
                let now = statement(STRIPE_PENDING)
                    .bind::<BigInt, _>(edge.job_id)
                    .bind::<Integer, _>(edge.stripe)
                    .get_result::<NullableInt>(c)?;
                let entry = refilled.entry(edge.job_id).or_default();
                if now.n == Some(1) {
                    *entry += 1;
                }
            }
            for (job, stripes) in refilled.into_iter().filter(|(_, n)| *n > 0) {
                statement(INCREMENT_STRIPES_PENDING)
                    .bind::<Integer, _>(stripes)
                    .bind::<BigInt, _>(job)
                    .execute(c)?;
            }
            Ok::<(), Error>(())
        })?;
    }
    Ok(())
}

//! Retention: pruning finished jobs by policy, a bounded number per call, never deleting one the
//! policy keeps, however many pruners and finishers run at once.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use crate::backend::statement::statement;
use crate::backend::transaction::{bare_write_transaction, retry_transient};
use crate::backend::{Dialect, dispatch};
use crate::jobs::queue::{check_count, ids_of};
use crate::rows::{IdRow, NullableAt};
use crate::sql_types::Instant;
use crate::{Error, Result, TenureConnection, validate};

/// Which finished jobs a policy is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Finished {
    /// Completed jobs.
    Completed,
    /// Dead jobs.
    Dead,
    /// Cancelled jobs.
    Cancelled,
}

impl Finished {
    pub(crate) fn state(self) -> &'static str {
        match self {
            Finished::Completed => "completed",
            Finished::Dead => "dead",
            Finished::Cancelled => "cancelled",
        }
    }
}

/// How many finished jobs of a queue to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Keep them all (prune deletes nothing).
    KeepAll,
    /// Delete them all (with a worker pruning every few seconds: "delete on completion").
    DeleteAll,
    /// Keep the newest N (by finish time). Jobs that finished at the same instant as the
    /// N-th newest are kept with it (a batch completed in one call shares one finish time),
    /// so a few more than N may stay: deciding among them by id would let a prune delete a
    /// job that finished, in another transaction, at that very instant after the prune read.
    KeepNewest(u64),
    /// Keep those that finished less than this long ago (database clock).
    KeepYoungerThan(Duration),
    /// Keep a job if it is among the newest N *or* younger than the age.
    KeepNewestOrYounger {
        /// How many of the newest to keep.
        newest: u64,
        /// Keep those younger than this.
        younger_than: Duration,
    },
}

/// The finish time of the N-th newest job: everything strictly older may go. Read in one
/// statement; a job that finishes later is newer than it, so a concurrent finisher can only
/// make the prune keep more, never delete a job the policy keeps (the failure of reading
/// the ids to keep and deleting the others in a second statement).
const NTH_NEWEST: &str = "\
    SELECT finished_at AS at FROM tenure_jobs WHERE queue = ? AND state = ? \
    ORDER BY finished_at DESC, id DESC LIMIT 1 OFFSET ?";

const NOW_PLUS: &str = "SELECT {now+ttl} AS at";

/// No unfinished job depends on it, nor a dead one (`retry_dead` may revive it, and it then
/// reads its dependencies' results again: they go once it is pruned itself). Dependencies
/// are added only under the lock of the job they point to, which the prune's lock
/// (skipping locked rows) re-checks this under.
macro_rules! not_needed {
    () => {
        "(dependents = 0 OR NOT EXISTS (\
    SELECT 1 FROM tenure_job_dependencies d JOIN tenure_jobs w ON w.id = d.job_id \
    WHERE d.depends_on = tenure_jobs.id AND w.state IN ('blocked', 'waiting', 'running', 'parked', 'dead')))"
    };
}

/// Finished jobs the policy does not keep, oldest first, leaving out those still inside
/// their dedup window (`{window_over}`) and those a job that has not finished (or died, and
/// may be revived) depends on (`not_needed!`: it may still read their results).
macro_rules! older_than {
    ($after:literal) => {
        concat!(
            "SELECT id, finished_at FROM tenure_jobs WHERE queue = ? AND state = ? AND finished_at < ?",
            $after,
            " AND (dedup_window_micros IS NULL OR {window_over}) AND ",
            not_needed!(),
            " ORDER BY finished_at, id LIMIT ?"
        )
    };
}
const OLDER_THAN: &str = older_than!("");

/// [`OLDER_THAN`] past a position in that order, `(finished_at, id)` (the last job the
/// previous batch of one pass picked): each batch starts where the last one ended instead
/// of walking again the index entries of every job the pass deleted (without vacuum, or
/// while a snapshot is held, they stay until their table or slot goes). The range on
/// `finished_at` is the index's, on every backend; the `id` test filters the few at the
/// same instant. A job behind the position (one that committed with an older finish time
/// after the position passed it, one whose dedup window closed since) is taken when the pass
/// starts from the first job again: every pass (a worker's pass is ten batches at most).
const OLDER_THAN_AFTER: &str = older_than!(" AND finished_at >= ? AND (finished_at > ? OR id > ?)");

/// PostgreSQL's job slots: the jobs of `kept` and of the three slots that stopped being
/// current longest ago (ring distance 3 to 5), the slots retention by slot
/// (`jobs::reclaim_job_slots`) has not taken by then: a job that policies keep, or one still
/// running, holds them. The three newest the reclaim takes whole, without a row version a job.
const OLDER_THAN_OLD_SLOTS: &str = older_than!(
    " AND (slot = -1 OR (pg_sequence_last_value('tenure_jobs_slot'::regclass) - slot + 6) % 6 >= 3)"
);
const OLDER_THAN_AFTER_OLD_SLOTS: &str = older_than!(
    " AND finished_at >= ? AND (finished_at > ? OR id > ?) AND (slot = -1 OR (pg_sequence_last_value('tenure_jobs_slot'::regclass) - slot + 6) % 6 >= 3)"
);

/// Where a pass of prunes has got to in `(finished_at, id)` order: see [`prune_after`].
pub(crate) type PruneCursor = (DateTime<Utc>, i64);

/// A finished job a prune picked, and its place in the prune's order.
#[derive(QueryableByName)]
struct OlderRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Instant)]
    finished_at: DateTime<Utc>,
}

/// The workflows of the jobs a prune deletes, locked in id order.
const LOCK_WORKFLOWS: &str =
    "SELECT id FROM tenure_workflows WHERE id IN {ids} ORDER BY id{for_update}";
/// Those workflows left without a job: their rows go with their last job. A job joins a
/// workflow only at enqueue, by a dependency it locks (which a prune skips) or with the
/// workflow it is created in, so no job joins a workflow this deletes.
const EMPTY_WORKFLOWS: &str = "\
    DELETE FROM tenure_workflows WHERE id IN {ids} \
    AND NOT EXISTS (SELECT 1 FROM tenure_jobs j WHERE j.workflow_id = tenure_workflows.id)";

/// Locks the picked rows by primary key alone (see `CLAIM_MARK` on why not by state), to
/// re-check their state before deleting; a job whose window an enqueue widened meanwhile (it
/// folded into the job, holding its lock) is no longer picked. Skipping rows another
/// transaction holds (a fold, a finisher; the next prune takes them), never waiting for
/// them: a locking read that waits meets those holders' locks while it fetches rows, and on
/// MariaDB a deadlock reported mid-fetch left the connection hanging on its next prune.
const LOCK_PICKED: &str = concat!(
    "SELECT id, state, workflow_id, dependents FROM tenure_jobs WHERE (dedup_window_micros IS NULL OR {window_over}) AND ",
    not_needed!(),
    " AND id IN {ids}{skip_locked}"
);

/// Of the locked rows that have dependents, those an unfinished (or dead) job now depends
/// on. A statement of its own, after the locks: its snapshot sees every edge an enqueue
/// committed before the prune took the row's lock (an enqueue of a dependent locks the
/// dependency first), which [`LOCK_PICKED`]'s own subquery may not (its snapshot is the
/// statement's start; a row updated and committed after it is re-checked on its newest
/// version, with the subquery as of the start: on PostgreSQL a dependent enqueued in that
/// window lost its dependency, 1 in 48 races under load).
const STILL_NEEDED: &str = concat!(
    "SELECT id FROM tenure_jobs WHERE id IN {ids} AND NOT ",
    not_needed!()
);

/// Deletes up to `max_jobs` finished jobs of `queue` that `policy` does not keep (and their
/// error history, outputs, results and steps); returns how many. Call it again while it
/// returns `max_jobs`. Needs a bare connection; each call is one short transaction.
///
/// Dedup windows come first: a finished job with a
/// [`dedup window`](crate::jobs::NewJob::dedup_window) is kept until `finished_at + window` has
/// passed on the database's clock, whatever the policy (even [`Retention::DeleteAll`]), so
/// that a prune never lets a duplicate through a window; after that the policy decides. A
/// kept job still counts for [`Retention::KeepNewest`]'s N.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, DedupOver, Finished, NewJob, Retention};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let job = NewJob::new("hooks", "deliver", vec![])
///     .dedup_key("evt_1")
///     .dedup_window(Duration::from_secs(3600), DedupOver::Completed);
/// jobs::enqueue(&mut conn, &job)?;
/// let claimed = jobs::claim(&mut conn, "hooks", 1, Duration::from_secs(60))?;
/// jobs::complete(&mut conn, &[claimed[0].claim()])?;
/// // Inside its hour the job stays, so the window still folds a redelivery into it.
/// assert_eq!(jobs::prune(&mut conn, "hooks", Finished::Completed, Retention::DeleteAll, 100)?, 0);
/// assert!(jobs::enqueue(&mut conn, &job)?.existing);
/// # Ok(()) }
/// ```
pub fn prune<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    finished: Finished,
    policy: Retention,
    max_jobs: usize,
) -> Result<usize> {
    prune_after(conn, queue, finished, policy, max_jobs, None, false).map(|(deleted, _)| deleted)
}

/// [`prune`] of the jobs after `after` in the prune's order (`None`: from the first), and
/// where this call got to (`None` when it picked nothing), of `kept` and the oldest job slots
/// alone when `old_slots_only` (PostgreSQL; see [`OLDER_THAN_OLD_SLOTS`]): a worker's pass
/// calls it again from there while it deletes full batches (ten at most a pass).
pub(crate) fn prune_after<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    finished: Finished,
    policy: Retention,
    max_jobs: usize,
    after: Option<PruneCursor>,
    old_slots_only: bool,
) -> Result<(usize, Option<PruneCursor>)> {
    validate::name("queue", queue)?;
    let max_jobs = check_count(max_jobs)?;
    let Some((newest, age_micros)) = policy_terms(policy)? else {
        return Ok((0, None));
    };
    let state = finished.state();
    // A deadlock with another prune (MariaDB, two prunes of one workflow's jobs) runs it again.
    retry_transient(|| {
        dispatch!(conn, c => {
            bare_write_transaction(c, "pruning jobs", |c| {
                let syntax = c.syntax();
                let Some(before) = cutoff(c, queue, state, newest, age_micros)? else {
                    return Ok((0, None));
                };
                let (older_first, older_after) = match old_slots_only && syntax.job_slots {
                    true => (OLDER_THAN_OLD_SLOTS, OLDER_THAN_AFTER_OLD_SLOTS),
                    false => (OLDER_THAN, OLDER_THAN_AFTER),
                };
                let older: Vec<OlderRow> = match after {
                    None => statement(syntax.render(older_first))
                        .bind::<Text, _>(queue)
                        .bind::<Text, _>(state)
                        .bind::<Instant, _>(before)
                        .bind::<BigInt, _>(max_jobs)
                        .load::<OlderRow>(c)?,
                    Some((at, id)) => statement(syntax.render(older_after))
                        .bind::<Text, _>(queue)
                        .bind::<Text, _>(state)
                        .bind::<Instant, _>(before)
                        .bind::<Instant, _>(at)
                        .bind::<Instant, _>(at)
                        .bind::<BigInt, _>(id)
                        .bind::<BigInt, _>(max_jobs)
                        .load::<OlderRow>(c)?,
                };
                let Some(last) = older.last() else {
                    return Ok((0, None));
                };
                let reached = Some((last.finished_at, last.id));
                let picked: Vec<i64> = older.iter().map(|row| row.id).collect();
                let locked: Vec<PickedRow> = statement(syntax.render(LOCK_PICKED))
                    .bind_ids(picked)
                    .load::<PickedRow>(c)?
                    .into_iter()
                    .filter(|row| row.state == state)
                    .collect();
                let with_dependents: Vec<i64> =
                    locked.iter().filter(|row| row.dependents > 0).map(|row| row.id).collect();
                let needed: Vec<i64> = if with_dependents.is_empty() {
                    Vec::new()
                } else {
                    statement(syntax.render(STILL_NEEDED)).bind_ids(with_dependents).load::<IdRow>(c).map(ids_of)?
                };
                let locked: Vec<PickedRow> = locked.into_iter().filter(|row| !needed.contains(&row.id)).collect();
                if locked.is_empty() {
                    return Ok((0, reached));
                }
                let doomed: Vec<i64> = locked.iter().map(|row| row.id).collect();
                let mut workflows: Vec<i64> = locked.iter().filter_map(|row| row.workflow_id).collect();
                workflows.sort_unstable();
                workflows.dedup();
                // Their workflows' rows locked before their jobs go: two prunes of one workflow's
                // last jobs take turns, so the later one sees the earlier one's deletes.
                if !workflows.is_empty() {
                    statement(syntax.render(LOCK_WORKFLOWS)).bind_ids(workflows.iter().copied()).load::<IdRow>(c)?;
                }
                let ids = || doomed.iter().copied();
                let deleted = statement("DELETE FROM tenure_jobs WHERE id IN {ids}").bind_ids(ids()).execute(c)?;
                if !workflows.is_empty() {
                    statement(EMPTY_WORKFLOWS).bind_ids(workflows).execute(c)?;
                }
                statement("DELETE FROM tenure_job_errors WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_job_outputs WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_job_limits WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_job_results WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_parked WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                // A step commits only while its run holds the job's claim, under the job row's
                // lock: none is written for a job this deletes (finished, locked here).
                statement("DELETE FROM tenure_steps WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_dependency_stripes WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_job_dependencies WHERE job_id IN {ids}").bind_ids(ids()).execute(c)?;
                statement("DELETE FROM tenure_job_dependencies WHERE depends_on IN {ids}").bind_ids(ids()).execute(c)?;
                Ok((deleted, reached))
            })
        })
    })
}

/// A policy's terms: the newest N it keeps and the age in microseconds under which it
/// keeps a job (`None`: it keeps them all).
type PolicyTerms = (Option<u64>, Option<i64>);

fn policy_terms(policy: Retention) -> Result<Option<PolicyTerms>> {
    let (newest, younger_than) = match policy {
        Retention::KeepAll => return Ok(None),
        Retention::DeleteAll => (None, None),
        Retention::KeepNewest(n) => (Some(n), None),
        Retention::KeepYoungerThan(age) => (None, Some(age)),
        Retention::KeepNewestOrYounger {
            newest,
            younger_than,
        } => (Some(newest), Some(younger_than)),
    };
    Ok(Some((
        newest,
        younger_than.map(validate::delay_micros).transpose()?,
    )))
}

/// The finish time before which `policy` lets `queue`'s jobs in `finished` go, by the
/// database's clock (the far future when it keeps none), or `None` when it keeps them all (or
/// fewer than its newest N have finished). Read before a prune or a reclaim decides: a job
/// that finishes later is newer than it, so a cutoff read early can only keep more.
pub(crate) fn policy_cutoff<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    finished: Finished,
    policy: Retention,
) -> Result<Option<DateTime<Utc>>> {
    validate::name("queue", queue)?;
    let Some((newest, age_micros)) = policy_terms(policy)? else {
        return Ok(None);
    };
    cutoff(conn, queue, finished.state(), newest, age_micros)
}

fn cutoff<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    state: &str,
    newest: Option<u64>,
    age_micros: Option<i64>,
) -> Result<Option<DateTime<Utc>>> {
    dispatch!(conn, c => {
        let syntax = c.syntax();
        // The newest-N cutoff, if the policy has one (None: fewer than N, keep all).
        let mut cutoff: Option<DateTime<Utc>> = None;
        if let Some(n) = newest.filter(|n| *n > 0) {
            let offset = i64::try_from(n - 1).map_err(|_| Error::invalid("newest", "too large"))?;
            let nth = statement(syntax.render(NTH_NEWEST))
                .bind::<Text, _>(queue)
                .bind::<Text, _>(state)
                .bind::<BigInt, _>(offset)
                .get_result::<NullableAt>(c)
                .optional()?;
            match nth.and_then(|row| row.at) {
                Some(at) => cutoff = Some(at),
                None => return Ok(None),
            }
        }
        if let Some(micros) = age_micros {
            let at = statement(syntax.render(NOW_PLUS))
                .bind::<BigInt, _>(-micros)
                .get_result::<NullableAt>(c)?
                .at;
            // Keep if newest-N *or* younger: delete only what is older than both.
            cutoff = match (cutoff, at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        // DeleteAll: no cutoff; the far future stands in for "any finish time".
        Ok(Some(clamp(cutoff.unwrap_or(DateTime::<Utc>::MAX_UTC))))
    })
}

/// A job a prune picked, as locked.
#[derive(QueryableByName)]
struct PickedRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    workflow_id: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    dependents: i32,
}

/// The latest whole second every backend stores (MySQL's DATETIME ends in year 9999; see
/// `validate::instant`).
fn clamp(at: DateTime<Utc>) -> DateTime<Utc> {
    let latest = DateTime::<Utc>::from_timestamp(validate::END_OF_INSTANTS_SECS - 1, 0);
    latest.map_or(at, |latest| at.min(latest))
}

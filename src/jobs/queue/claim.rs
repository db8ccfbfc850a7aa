//! Claiming due jobs, within their flow control (the queue's limit, pauses, and the limits
//! of their keys: `flow::admission` decides), by kind or of any kind.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Nullable, Text};

use super::model::{Candidate, ClaimOrder, JobRow};
use super::{ClaimedJob, MAX_BATCH, MAX_KINDS, check_count};
use crate::backend::statement::statement;
use crate::backend::transaction::{bare_write_transaction, retry_transient};
use crate::backend::{Dialect, dispatch};
use crate::jobs::flow::admission;
use crate::{Error, Result, TenureConnection, validate};

/// What a claim reads back of the jobs it claimed ([`super::model::JobRow`]).
const CLAIMED_COLUMNS: &str = "id, queue, kind, payload, priority, attempt, max_attempts, \
    due_at, created_at, claim_token, claimed_at, claim_expires_at, lapses";

/// Claim, step 1 of 3: lock the jobs to claim, in order, skipping rows other claimers hold
/// (PostgreSQL: their ring entries, the mark locks the jobs; SQLite: the IMMEDIATE
/// transaction serializes claimers), at most as many as a limited
/// queue has room for (step 0). Nothing from a paused queue. Subqueries are plain reads: a locking
/// clause does not lock what they read. Jobs with a key that has no room now for them (its
/// running jobs fill the smallest cap among them or the job's own cap, or the rate it is
/// throttled on is full and the job's rate on it is as strict or stricter: `throttled_until`)
/// are left out, so they do not crowd out the others; these reads are only a filter (step 2
/// decides, by the same rule, under the locks). The own-cap count runs only for capped
/// candidates, over the running capped jobs (`tenure_jobs_limit`), never the waiting ones.
/// A job without limits (`limit_key IS NULL`) never reads `tenure_job_limits`. The index on
/// `(queue, [state,] priority, due_at, id)` serves filter and order, so InnoDB reads (and
/// locks) only the rows it returns. MySQL rejects LIMIT in an `IN (subquery)`, hence
/// separate statements. Its two shapes: of any kind ([`CLAIM_PICK`]), of one kind
/// ([`CLAIM_PICK_KIND`], see below).
macro_rules! claim_pick {
    ($from:literal, $kinds:literal) => {
        claim_pick!($from, $kinds, " \
      AND (c.limit_key IS NULL OR NOT EXISTS ( \
          SELECT 1 FROM tenure_job_limits l WHERE l.job_id = c.id AND ( \
              (l.rate_max IS NOT NULL AND EXISTS ( \
                  SELECT 1 FROM tenure_limit_keys t WHERE t.limit_key = l.limit_key \
                  AND t.throttled_until > {now} AND l.rate_max <= t.throttled_max \
                  AND l.rate_period_us >= t.throttled_period_us)) \
              OR (l.max_running IS NOT NULL AND (l.limit_key IN ( \
                  SELECT s.limit_key FROM tenure_jobs r JOIN tenure_job_limits s ON s.job_id = r.id \
                  WHERE r.state = 'running' AND r.limit_key IS NOT NULL AND s.max_running IS NOT NULL \
                  GROUP BY s.limit_key HAVING COUNT(*) >= MIN(s.max_running)) \
                OR l.max_running <= ( \
                  SELECT COUNT(*) FROM tenure_jobs r JOIN tenure_job_limits s ON s.job_id = r.id \
                  WHERE r.state = 'running' AND r.limit_key IS NOT NULL \
                  AND s.limit_key = l.limit_key AND s.max_running IS NOT NULL))))))")
    };
    ($from:literal, $kinds:literal, $limits:literal) => {
        concat!(
            "SELECT c.id, c.priority, c.fair_stamp, c.due_at, c.limit_key, {pick_slot} AS job_slot FROM ",
            $from,
            " WHERE c.queue = ?{claim_waiting} AND c.due_at <= {now}",
            $kinds,
            " \
      AND NOT EXISTS (SELECT 1 FROM tenure_queue_pauses p WHERE p.queue = ?)",
            $limits,
            " \
    ORDER BY c.priority, c.fair_stamp, c.due_at, c.id LIMIT ?{claim_lock}"
        )
    };
}

/// [`claim_pick!`] of any kind, through the claim index.
const CLAIM_PICK: &str = claim_pick!("{claim_from}", "");
/// A claim of some kinds picks per kind, served by `tenure_jobs_claim_kind`
/// `(queue, [state,] kind, priority, due_at, id)`: one kind is one range of it, read in claim
/// order and skipping rows other claimers hold, so waiting jobs of other kinds are never read
/// nor locked however many sit ahead. Several kinds are one such pick each (up to `max_jobs`
/// rows each), merged in claim order and cut to `max_jobs`: the same jobs one pick over the
/// listed kinds would take, without sorting (or, on MySQL/MariaDB, locking) every due job
/// of those kinds. Rows picked and not kept stay locked only until the claim commits.
const CLAIM_PICK_KIND: &str = claim_pick!("{claim_kind_from}", " AND c.kind = ?");

/// The picks without the limits' filter, for PostgreSQL's job slots: the filter's counts
/// read `tenure_jobs`, and a generic plan locks every relation it names at each execution,
/// run or not (seven partitions and their indexes). When none of the first jobs has a
/// limit key, the filter would have changed nothing; otherwise the pick is made again with
/// it.
const CLAIM_PICK_UNFILTERED: &str = claim_pick!("{claim_from}", "", "");
const CLAIM_PICK_KIND_UNFILTERED: &str = claim_pick!("{claim_kind_from}", " AND c.kind = ?", "");

/// Claim, step 3: claim exactly the accepted ids (a bound list, see `backend::statement`),
/// each with its own random token, recording the worker that claims (NULL outside a worker).
/// The WHERE is the primary key alone, so no other index can serve it (a `state = ...`
/// condition could be served by the stalled-claims index on MySQL, locking other rows). On
/// PostgreSQL the accepted ids that still wait and no other transaction holds
/// (`{claim_mark_ids}`): the pick locked only their entries.
/// RETURNING where there is one; MySQL reads them back. A claim outside a worker is its run's
/// start (its caller runs it); a worker records the starts it must (`worker::runs`).
const CLAIM_MARK: &str = "\
    UPDATE {jobs} SET state = 'running', attempt = attempt + 1, \
        claim_token = {slot_token}, claimed_at = {now}, claim_expires_at = {now+ttl}, \
        claimed_by = ?, started_at = CASE WHEN ? THEN {now} ELSE NULL END \
    WHERE {claim_mark_ids}{in_transaction}";

/// Claims up to `max_jobs` due jobs of `queue` for `ttl`, by priority, then due time, then id
/// (fair jobs, within a priority, by their tenants' turns: [`NewJob::fair_key`](super::NewJob::fair_key)).
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
    max_jobs: usize,
    ttl: Duration,
) -> Result<Vec<ClaimedJob>> {
    Ok(claim_of(conn, queue, None, max_jobs, ttl, None)?.0)
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
    max_jobs: usize,
    ttl: Duration,
) -> Result<Vec<ClaimedJob>> {
    let names = kind_names(kinds)?;
    Ok(claim_of(conn, queue, Some(&names), max_jobs, ttl, None)?.0)
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
    max_jobs: usize,
    ttl: Duration,
    worker: Option<i64>,
) -> Result<(Vec<ClaimedJob>, Option<Duration>)> {
    let names = kind_names(kinds)?;
    claim_of(conn, queue, Some(&names), max_jobs, ttl, worker)
}

/// [`claim`], of the given kinds only (`Some`, validated and non-empty) or of any kind, by
/// `worker` if a registered worker claims, and how long until the soonest rate it found full
/// has room again.
fn claim_of<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    kinds: Option<&[&str]>,
    max_jobs: usize,
    ttl: Duration,
    worker: Option<i64>,
) -> Result<(Vec<ClaimedJob>, Option<Duration>)> {
    validate::name("queue", queue)?;
    let micros = validate::ttl(ttl)?;
    let max_jobs = check_count(max_jobs)?;
    // Keys a first attempt found held by other claimers, with nothing else to take: the
    // second attempt waits for them first (`admission::lock_first`).
    let mut first_keys = BTreeSet::new();
    let (rows, throttled_for, order) = loop {
        // A deadlock or serialization failure (MariaDB, many claimers on one limit key) runs the
        // whole claim again: nothing of the failed attempt was committed.
        let (rows, throttled_for, busy_keys, order): (
            Vec<JobRow>,
            Option<Duration>,
            BTreeSet<String>,
            HashMap<i64, ClaimOrder>,
        ) = retry_transient(|| {
            dispatch!(conn, c => {
                bare_write_transaction(c, "claiming jobs", |c| {
                    let syntax = c.syntax();
                    // Step 0: a limited queue's lock, before any job row is locked (one order for
                    // every claimer: queue, jobs, keys), and its room; none left, nothing to pick.
                    let queue_room = admission::lock_queue(c, queue)?;
                    let max_jobs = match queue_room {
                        Some(room) if room <= 0 => {
                            return Ok((Vec::new(), None, BTreeSet::new(), HashMap::new()));
                        }
                        Some(room) => max_jobs.min(room),
                        None => max_jobs,
                    };
                    // A paused queue yields no candidates (the pick's NOT EXISTS), in the same
                    // statement.
                    // One pick: the first `limit` due jobs in claim order.
                    let pick_with = |c: &mut _, limit: i64, filtered: bool| {
                        let (any_kind, of_kinds) = match filtered {
                            true => (CLAIM_PICK, CLAIM_PICK_KIND),
                            false => (CLAIM_PICK_UNFILTERED, CLAIM_PICK_KIND_UNFILTERED),
                        };
                        Ok::<Vec<Candidate>, Error>(match kinds {
                            None => statement(syntax.render(any_kind))
                                .bind::<Text, _>(queue)
                                .bind::<Text, _>(queue)
                                .bind::<BigInt, _>(limit)
                                .load::<Candidate>(c)?,
                            Some(kinds) => {
                                let pick = syntax.render(of_kinds);
                                let mut candidates = Vec::new();
                                for kind in kinds {
                                    candidates.extend(
                                        statement(pick)
                                            .bind::<Text, _>(queue)
                                            .bind::<Text, _>(*kind)
                                            .bind::<Text, _>(queue)
                                            .bind::<BigInt, _>(limit)
                                            .load::<Candidate>(c)?,
                                    );
                                }
                                candidates.sort_by_key(Candidate::claim_order);
                                candidates.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
                                candidates
                            }
                        })
                    };
                    let pick = |c: &mut _, limit: i64| -> Result<Vec<Candidate>> {
                        if syntax.job_slots {
                            let candidates = pick_with(c, limit, false)?;
                            if candidates.iter().all(|candidate| candidate.limit_key.is_none()) {
                                return Ok(candidates);
                            }
                        }
                        pick_with(c, limit, true)
                    };
                    let mut held = BTreeSet::new();
                    admission::lock_first(c, &first_keys, &mut held)?;
                    // Jobs the mark passed over (PostgreSQL: another transaction holds the job,
                    // `{claim_mark_ids}`). Their entries stay locked by this claim, so a pick
                    // returns them again: it reads past them and leaves them out.
                    let mut passed: BTreeSet<i64> = BTreeSet::new();
                    // The first `limit` due jobs in claim order not passed over, and whether
                    // the pick was full (more may wait behind it).
                    let pick_past = |c: &mut _, limit: i64, passed: &BTreeSet<i64>| {
                        let past = limit + passed.len() as i64;
                        let mut candidates = pick(c, past)?;
                        let full = candidates.len() as i64 >= past;
                        candidates.retain(|candidate| !passed.contains(&candidate.id));
                        Ok::<_, Error>((candidates, full))
                    };
                    let mut rows: Vec<JobRow> = Vec::new();
                    let mut order: HashMap<i64, ClaimOrder> = HashMap::new();
                    let mut throttled_for: Option<Duration> = None;
                    // A claim whose mark passed jobs over picks again for the room they leave
                    // (a claim of one must not come back empty while the job ahead is held and
                    // others wait), at most eight rounds: a claim comes back short only when
                    // the jobs it reaches are held eight times over. Elsewhere the pick locked
                    // the jobs, the mark passes none over, and there is one round.
                    for _round in 0..8 {
                        let wanted = max_jobs - rows.len() as i64;
                        let room = queue_room.map(|room| room - rows.len() as i64);
                        let mut limit = wanted;
                        let (mut candidates, mut full) = pick_past(c, limit, &passed)?;
                        let mut admission =
                            admission::admit(c, queue, room, &candidates, wanted, &mut held)?;
                        // The pick's filter reads the keys before their locks (and a key's hint
                        // names one full rate): candidates admission refused may fill a full pick
                        // while admissible jobs wait behind them. Then the pick is made once more,
                        // four times as large (up to MAX_BATCH; this transaction holds the refused
                        // rows' locks, so SKIP LOCKED returns them again), and admission decides
                        // over it all. Once: a key full for all its jobs (a rate's window) must
                        // not make every claim read deep into them. The same statement with a
                        // larger LIMIT (a keyset "past the last candidate" cost PostgreSQL a plan
                        // that read every waiting row). Never for a queue whose candidates are all
                        // admitted (no limits): no cost there. Again (four times larger each time,
                        // up to MAX_BATCH) while candidates were refused only because another
                        // claimer held their key, which this transaction could not wait for in
                        // key order (`admission::admit`).
                        let mut widened = false;
                        while (admission.ids.len() as i64) < wanted
                            && full
                            && limit < MAX_BATCH as i64
                            && (!widened || !admission.busy_keys.is_empty())
                        {
                            widened = true;
                            limit = (limit * 4).min(MAX_BATCH as i64);
                            (candidates, full) = pick_past(c, limit, &passed)?;
                            admission =
                                admission::admit(c, queue, room, &candidates, wanted, &mut held)?;
                        }
                        if admission.ids.is_empty() {
                            if !rows.is_empty() {
                                break;
                            }
                            if first_keys.is_empty() && !admission.busy_keys.is_empty() {
                                // Ends this transaction (it wrote nothing), releasing its keys.
                                return Ok((Vec::new(), None, admission.busy_keys, HashMap::new()));
                            }
                            // Rates whose windows filled meanwhile still get their hints.
                            let throttled_for = admission::record_starts(c, &admission, &[])?;
                            return Ok((Vec::new(), throttled_for, BTreeSet::new(), HashMap::new()));
                        }
                        let ids = admission.ids.clone();
                        // Candidates admission refused may fit in the room a passed-over job
                        // leaves (a key's cap), as may jobs behind a full pick.
                        let more = full || candidates.len() > ids.len();
                        for candidate in &candidates {
                            order.insert(candidate.id, candidate.claim_order());
                        }
                        // One mark per slot among the ids (PostgreSQL's job slots: each names
                        // its slot's partition; elsewhere one).
                        let slot_of: HashMap<i64, i64> = candidates
                            .iter()
                            .map(|candidate| (candidate.id, candidate.job_slot))
                            .collect();
                        let mut by_slot: Vec<(Option<i64>, Vec<i64>)> = Vec::new();
                        for id in &ids {
                            let slot = syntax.job_slots.then(|| slot_of.get(id).copied()).flatten();
                            match by_slot.iter_mut().find(|(s, _)| *s == slot) {
                                Some((_, group)) => group.push(*id),
                                None => by_slot.push((slot, vec![*id])),
                            }
                        }
                        let mut marked: Vec<JobRow> = Vec::new();
                        for (slot, ids) in &by_slot {
                            let mark = syntax.render_with(CLAIM_MARK, &syntax.slot_jobs(*slot));
                            let group = if syntax.returning {
                                let marked = format!("{mark} RETURNING {CLAIMED_COLUMNS}");
                                let sql = match syntax.claim_forget {
                                    Some(forget) => forget.replace("{marked}", &marked),
                                    None => marked,
                                };
                                statement(sql)
                                    .bind::<BigInt, _>(micros)
                                    .bind::<Nullable<BigInt>, _>(worker)
                                    .bind::<Bool, _>(worker.is_none())
                                    .bind_ids(ids.iter().copied())
                                    .load::<JobRow>(c)?
                            } else {
                                // The mark and its read count only while this transaction
                                // lives (`{in_transaction}`): Galera may roll it back between two
                                // statements (a conflict with another node's claim), and a mark
                                // run on its own committed a claim nobody held (a job running
                                // under an unknown token); a read on its own returned the rows
                                // as they are, waiting or another claim's.
                                let marked = statement(mark)
                                    .bind::<BigInt, _>(micros)
                                    .bind::<Nullable<BigInt>, _>(worker)
                                    .bind::<Bool, _>(worker.is_none())
                                    .bind_ids(ids.iter().copied())
                                    .execute(c)?;
                                if marked != ids.len() {
                                    return Err(Error::RolledBackUnderUs { operation: "claim" });
                                }
                                let read = statement(format!(
                                    "SELECT {CLAIMED_COLUMNS} FROM tenure_jobs WHERE id IN {{ids}} \
                                     AND @@in_transaction = 1"
                                ))
                                .bind_ids(ids.iter().copied())
                                .load::<JobRow>(c)?;
                                if read.len() != ids.len() {
                                    return Err(Error::RolledBackUnderUs { operation: "claim" });
                                }
                                read
                            };
                            marked.extend(group);
                        }
                        // Each round's starts before the next round's admission reads them.
                        let starts: Vec<_> = marked
                            .iter()
                            .filter_map(|row| row.claimed_at.map(|at| (row.id, at)))
                            .collect();
                        if let Some(until) = admission::record_starts(c, &admission, &starts)? {
                            throttled_for = Some(throttled_for.map_or(until, |t| t.min(until)));
                        }
                        let taken: BTreeSet<i64> = marked.iter().map(|row| row.id).collect();
                        rows.extend(marked);
                        let skipped: Vec<i64> =
                            ids.into_iter().filter(|id| !taken.contains(id)).collect();
                        if skipped.is_empty() || rows.len() as i64 >= max_jobs || !more {
                            break;
                        }
                        passed.extend(skipped);
                    }
                    Ok((rows, throttled_for, BTreeSet::new(), order))
                })
            })
        })?;
        if busy_keys.is_empty() {
            break (rows, throttled_for, order);
        }
        first_keys = busy_keys;
    };
    let mut claimed = rows
        .into_iter()
        .map(ClaimedJob::from_row)
        .collect::<Result<Vec<_>>>()?;
    // Claim order (RETURNING has none), by the picks' keys: a later round's job may come
    // before an earlier round's (one a key's room refused until a held job was passed over).
    claimed.sort_by_key(|job| order.get(&job.id).copied());
    Ok((claimed, throttled_for))
}

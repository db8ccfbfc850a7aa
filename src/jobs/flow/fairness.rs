//! Fair claiming across tenants ([`crate::jobs::NewJob::fair_key`]): start-time fair
//! queueing, decided at enqueue so that a claim stays one ordered index read.
//!
//! Each priority of a queue has a virtual time, how far its tenants' turns have come (see
//! [`VIRTUAL_NOW`]). A due job of tenant `k` gets the stamp `max(last, virtual time) + UNIT /
//! weight(k)`, where `last` is the stamp of `k`'s last waiting job at that priority (none:
//! the tenant has no backlog, and starts at the virtual time), and claims order by
//! priority, then stamp, then due time. A tenant with a backlog has stamps far ahead; one
//! that arrives later starts at the virtual time, so its jobs interleave with the backlog's
//! next ones (round-robin when weights are equal) instead of waiting behind all of it. A
//! job not due yet takes the virtual time's next turn without moving its tenant's: jobs
//! scheduled for later do not push the tenant's due work back. `last` is read from the
//! jobs that wait, so jobs cancelled, folded into a duplicate or run do not count. The cost
//! of a claim does not depend on the number of tenants: the claim index holds the stamp,
//! and the pick reads it in order as before. A lone tenant's stamps simply grow: it gets all
//! the capacity (work-conserving).
//!
//! Per queue and tenant a row (`tenure_fair_keys`) holds the weight; an enqueue locks it (in
//! key order, for a batch of several tenants) before it reads `last`, so no two due jobs of
//! a tenant enqueued in READ COMMITTED transactions share a turn however many producers it
//! has.
//!
//! What this does not do (README): a job blocked, parked or scheduled for later when it is
//! enqueued, or retrying, keeps the turn of its enqueue, and such jobs may share turns; a
//! caller's REPEATABLE READ snapshot reads stale turns; a fair job nobody claims, with the
//! queue's completed jobs pruned, holds the virtual time back. Re-stamping jobs as they
//! become runnable, and a virtual time kept by the claims, would remove these.

use std::borrow::Cow;
use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{Integer, Text};

use crate::backend::statement::statement;
use crate::backend::{Dialect, Upsert, dispatch};
use crate::jobs::NewJob;
use crate::rows::Count;
use crate::{Error, Result, TenureConnection, validate};

/// The largest weight a tenant may have ([`set_fair_weight`]).
pub const MAX_FAIR_WEIGHT: u32 = 1000;

/// What one job of a weight-1 tenant moves its tenant's stamp by (a weight-w tenant's: this
/// over w, so weights up to [`MAX_FAIR_WEIGHT`] divide it exactly enough).
const UNIT: i64 = 1_000_000;

const ENSURE_ON_CONFLICT: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight) VALUES (?, ?, 1) \
    ON CONFLICT (queue, fair_key) DO NOTHING";
const ENSURE_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight) VALUES (?, ?, 1) \
    ON DUPLICATE KEY UPDATE queue = queue";
/// SQLite's IMMEDIATE transaction holds the database's write lock: no row lock needed.
const LOCK_KEY: &str =
    "SELECT weight AS n FROM tenure_fair_keys WHERE queue = ? AND fair_key = ?{for_update}";
/// The stamp of the tenant's last waiting job at the priority (0: none), read after its
/// row's lock (a READ COMMITTED statement sees the turns its producers committed).
const LAST_WAITING: &str = "SELECT COALESCE((SELECT c.fair_stamp FROM {fair_waiting_from} \
    AND c.queue = ? AND {fair_key_is} AND c.priority = ? \
    ORDER BY c.fair_key DESC, c.fair_stamp DESC LIMIT 1), 0) AS n";
/// The virtual time of a queue's priority: the greatest of the stamp of the first due fair
/// job a claim would take, the stamps of its running jobs, and those of its 64 jobs
/// completed last (one kind nobody claims, or a job its limit holds, must not keep it back:
/// a tenant arriving would then be stamped ahead of every backlog that moved on). Per
/// priority: one urgent job of a tenant with a backlog runs early with a stamp far ahead,
/// which must not push a tenant arriving at another priority behind that backlog. Index
/// reads, bounded: the claim index from the priority's first fair entry, the queue's
/// running jobs, its finished jobs by finish time.
const VIRTUAL_NOW: &str = "SELECT {greatest}(\
    COALESCE((SELECT c.fair_stamp FROM {claim_from} WHERE c.queue = ?{claim_waiting} \
        AND c.priority = ? AND c.fair_stamp > 0 AND c.due_at <= {now} \
        ORDER BY c.fair_stamp LIMIT 1), 0), \
    COALESCE((SELECT MAX(fair_stamp) FROM tenure_jobs WHERE queue = ? AND state = 'running' \
        AND priority = ?), 0), \
    COALESCE((SELECT MAX(r.fair_stamp) FROM (SELECT fair_stamp, priority FROM tenure_jobs \
        WHERE queue = ? AND state = 'completed' ORDER BY finished_at DESC LIMIT 64) r \
        WHERE r.priority = ?), 0)) AS n";

const SET_WEIGHT_ON_CONFLICT: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight) VALUES (?, ?, ?) \
    ON CONFLICT (queue, fair_key) DO UPDATE SET weight = excluded.weight";
const SET_WEIGHT_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight) VALUES (?, ?, ?) \
    ON DUPLICATE KEY UPDATE weight = VALUES(weight)";

#[derive(QueryableByName)]
struct Weight {
    #[diesel(sql_type = Integer)]
    n: i32,
}

/// `jobs` with their stamps, in the enqueue's transaction (borrowed unchanged when none has
/// a fair key). Locks each tenant's row in (queue, key) order, then gives the tenant's due
/// jobs consecutive turns per priority in the batch's order, after its last waiting one.
pub(crate) fn stamped<'a, C: TenureConnection>(
    conn: &mut C,
    jobs: &'a [NewJob],
) -> Result<Cow<'a, [NewJob]>> {
    let mut tenants: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for (i, job) in jobs.iter().enumerate() {
        if let Some(key) = &job.fair_key {
            tenants
                .entry((job.queue.as_str(), key.as_str()))
                .or_default()
                .push(i);
        }
    }
    if tenants.is_empty() {
        return Ok(Cow::Borrowed(jobs));
    }
    let mut weights = Vec::with_capacity(tenants.len());
    for &(queue, key) in tenants.keys() {
        weights.push(lock_key(conn, queue, key)?);
    }
    let mut times: BTreeMap<(&str, i32), i64> = BTreeMap::new();
    let mut out = jobs.to_vec();
    for (((queue, key), indexes), weight) in tenants.into_iter().zip(weights) {
        let step = UNIT / i64::from(weight.clamp(1, MAX_FAIR_WEIGHT as i32));
        // Per priority: the tenant's last turn given so far.
        let mut last: BTreeMap<i32, i64> = BTreeMap::new();
        for i in indexes {
            let priority = jobs[i].priority;
            let now = match times.get(&(queue, priority)) {
                Some(&now) => now,
                None => {
                    let now = virtual_now(conn, queue, priority)?;
                    times.insert((queue, priority), now);
                    now
                }
            };
            let exhausted = || Error::invalid("fair key", "its tenant's turns are exhausted");
            let (at, delay) = jobs[i].due_params();
            if at.is_some() || delay > 0 {
                // Not due yet: the next turn now, the tenant's own turns left where they are.
                out[i].fair_stamp = now.checked_add(step).ok_or_else(exhausted)?;
                continue;
            }
            let previous = match last.get(&priority) {
                Some(&previous) => previous,
                None => last_waiting(conn, queue, key, priority)?,
            };
            let stamp = previous.max(now).checked_add(step).ok_or_else(exhausted)?;
            last.insert(priority, stamp);
            out[i].fair_stamp = stamp;
        }
    }
    Ok(Cow::Owned(out))
}

/// Locks (making it if new) the row of tenant `key` in `queue`; returns its weight.
fn lock_key<C: TenureConnection>(conn: &mut C, queue: &str, key: &str) -> Result<i32> {
    Ok(dispatch!(conn, c => {
        let syntax = c.syntax();
        let ensure = match syntax.upsert {
            Upsert::OnConflictWhere => ENSURE_ON_CONFLICT,
            Upsert::OnDuplicateKey => ENSURE_ON_DUPLICATE_KEY,
        };
        statement(ensure).bind::<Text, _>(queue).bind::<Text, _>(key).execute(c)?;
        statement(syntax.render(LOCK_KEY))
            .bind::<Text, _>(queue)
            .bind::<Text, _>(key)
            .get_result::<Weight>(c)
    })?
    .n)
}

/// [`VIRTUAL_NOW`] of `queue`'s `priority`.
fn virtual_now<C: TenureConnection>(conn: &mut C, queue: &str, priority: i32) -> Result<i64> {
    Ok(dispatch!(conn, c => {
        statement(c.syntax().render(VIRTUAL_NOW))
            .bind::<Text, _>(queue)
            .bind::<Integer, _>(priority)
            .bind::<Text, _>(queue)
            .bind::<Integer, _>(priority)
            .bind::<Text, _>(queue)
            .bind::<Integer, _>(priority)
            .get_result::<Count>(c)
    })?
    .n)
}

/// [`LAST_WAITING`] of tenant `key` at `queue`'s `priority`.
fn last_waiting<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    key: &str,
    priority: i32,
) -> Result<i64> {
    Ok(dispatch!(conn, c => {
        statement(c.syntax().render(LAST_WAITING))
            .bind::<Text, _>(queue)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Integer, _>(priority)
            .get_result::<Count>(c)
    })?
    .n)
}

/// Sets tenant `key`'s weight in `queue` (1 to [`MAX_FAIR_WEIGHT`]; a tenant without one has
/// weight 1): while both have jobs waiting, a tenant of weight 3 is claimed about three
/// times as often as one of weight 1. Applies to the tenant's jobs enqueued afterwards.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// jobs::set_fair_weight(&mut conn, "sync", "premium", 3)?;
/// let batch: Vec<_> = (0..8)
///     .flat_map(|_| ["premium", "basic"])
///     .map(|tenant| NewJob::new("sync", tenant, vec![]).fair_key(tenant))
///     .collect();
/// jobs::enqueue_many(&mut conn, &batch)?;
/// let first = jobs::claim(&mut conn, "sync", 8, Duration::from_secs(60))?;
/// assert_eq!(first.iter().filter(|job| job.kind == "premium").count(), 6);
/// # Ok(()) }
/// ```
pub fn set_fair_weight<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    key: &str,
    weight: u32,
) -> Result<()> {
    validate::name("queue", queue)?;
    validate::name("fair key", key)?;
    if !(1..=MAX_FAIR_WEIGHT).contains(&weight) {
        return Err(Error::invalid(
            "fair weight",
            format!("{weight} is not between 1 and {MAX_FAIR_WEIGHT}"),
        ));
    }
    dispatch!(conn, c => {
        let sql = match c.syntax().upsert {
            Upsert::OnConflictWhere => SET_WEIGHT_ON_CONFLICT,
            Upsert::OnDuplicateKey => SET_WEIGHT_ON_DUPLICATE_KEY,
        };
        statement(sql)
            .bind::<Text, _>(queue)
            .bind::<Text, _>(key)
            .bind::<Integer, _>(weight as i32)
            .execute(c)
    })?;
    Ok(())
}

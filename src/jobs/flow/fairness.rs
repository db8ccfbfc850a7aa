//! Fair claiming across tenants ([`crate::jobs::NewJob::fair_key`]): start-time fair
//! queueing, decided at enqueue so that a claim stays one ordered index read.
//!
//! Each queue has a virtual time: the greatest stamp among its running jobs and its head's
//! (the first fair job a claim would take). A job of tenant `k` gets the stamp
//! `max(k's last stamp, virtual time) + UNIT / weight(k)`, and claims order by priority,
//! then stamp, then due time. A tenant with a backlog has stamps far ahead; one that arrives
//! later starts at the virtual time, so its jobs interleave with the backlog's next ones
//! (round-robin when weights are equal) instead of waiting behind all of it. The cost of a
//! claim does not depend on the number of tenants: the claim index holds the stamp, and
//! the pick reads it in order as before. A lone tenant's stamps simply grow: it gets all the
//! capacity (work-conserving).
//!
//! Per queue and tenant a row (`tenure_fair_keys`) holds the weight and the last stamp; an
//! enqueue locks it (in key order, for a batch of several tenants) and moves it on in its
//! transaction, so no two jobs of a tenant share a stamp however many producers it has.

use std::borrow::Cow;
use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};

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
    INSERT INTO tenure_fair_keys (queue, fair_key, weight, last_stamp) VALUES (?, ?, 1, 0) \
    ON CONFLICT (queue, fair_key) DO NOTHING";
const ENSURE_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight, last_stamp) VALUES (?, ?, 1, 0) \
    ON DUPLICATE KEY UPDATE queue = queue";
/// SQLite's IMMEDIATE transaction holds the database's write lock: no row lock needed.
const LOCK_KEY: &str = "SELECT weight, last_stamp FROM tenure_fair_keys \
    WHERE queue = ? AND fair_key = ?{for_update}";
const MOVE_ON: &str = "UPDATE tenure_fair_keys SET last_stamp = ? WHERE queue = ? AND fair_key = ?";
/// The queue's virtual time: the greatest stamp of its running jobs and its head's. Both
/// are index reads (the running jobs of the queue; the claim index in claim order, up to the
/// first fair entry).
const VIRTUAL_NOW: &str = "SELECT {greatest}(\
    COALESCE((SELECT MAX(fair_stamp) FROM tenure_jobs WHERE queue = ? AND state = 'running'), 0), \
    COALESCE((SELECT c.fair_stamp FROM {claim_from} WHERE c.queue = ?{claim_waiting} \
        AND c.fair_stamp > 0 ORDER BY c.priority, c.fair_stamp LIMIT 1), 0)) AS n";

const SET_WEIGHT_ON_CONFLICT: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight, last_stamp) VALUES (?, ?, ?, 0) \
    ON CONFLICT (queue, fair_key) DO UPDATE SET weight = excluded.weight";
const SET_WEIGHT_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_fair_keys (queue, fair_key, weight, last_stamp) VALUES (?, ?, ?, 0) \
    ON DUPLICATE KEY UPDATE weight = VALUES(weight)";

#[derive(QueryableByName)]
struct KeyRow {
    #[diesel(sql_type = Integer)]
    weight: i32,
    #[diesel(sql_type = BigInt)]
    last_stamp: i64,
}

/// `jobs` with their stamps, in the enqueue's transaction (borrowed unchanged when none has
/// a fair key). Locks each tenant's row in (queue, key) order, then gives the tenant's jobs
/// consecutive stamps in the batch's order.
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
    let mut locked = Vec::with_capacity(tenants.len());
    for &(queue, key) in tenants.keys() {
        locked.push(lock_key(conn, queue, key)?);
    }
    let mut virtual_now: BTreeMap<&str, i64> = BTreeMap::new();
    let mut out = jobs.to_vec();
    for (((queue, key), indexes), row) in tenants.into_iter().zip(locked) {
        let now = match virtual_now.get(queue) {
            Some(&now) => now,
            None => {
                let now = read_virtual_now(conn, queue)?;
                virtual_now.insert(queue, now);
                now
            }
        };
        let step = UNIT / i64::from(row.weight.clamp(1, MAX_FAIR_WEIGHT as i32));
        let mut stamp = row.last_stamp.max(now);
        for i in indexes {
            stamp = stamp
                .checked_add(step)
                .ok_or_else(|| Error::invalid("fair key", "its tenant's stamps are exhausted"))?;
            out[i].fair_stamp = stamp;
        }
        dispatch!(conn, c => {
            statement(MOVE_ON)
                .bind::<BigInt, _>(stamp)
                .bind::<Text, _>(queue)
                .bind::<Text, _>(key)
                .execute(c)
        })?;
    }
    Ok(Cow::Owned(out))
}

/// Locks (making it if new) the row of tenant `key` in `queue`.
fn lock_key<C: TenureConnection>(conn: &mut C, queue: &str, key: &str) -> Result<KeyRow> {
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
            .get_result::<KeyRow>(c)
    })?)
}

fn read_virtual_now<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<i64> {
    Ok(dispatch!(conn, c => {
        statement(c.syntax().render(VIRTUAL_NOW))
            .bind::<Text, _>(queue)
            .bind::<Text, _>(queue)
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

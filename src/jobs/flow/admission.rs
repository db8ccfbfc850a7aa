//! Claim, step 2: which of the picked candidates may start now, within their queue's
//! concurrency limit and every limit their keys carry ([`crate::jobs::Limit`]), decided under the
//! locks of that queue and of those keys; and, after the claim, the starts it made.
//!
//! Locks are taken in one order by every claimer (the queue's row, then the keys' rows by
//! key), so claimers never wait on each other in a cycle; nothing else locks them. A claim
//! that admits twice (its wider second pick) already holds keys: it waits only for keys
//! that sort after all of them, and takes one that sorts before only if no one holds it
//! (`SKIP LOCKED`), else refuses that key's candidates this time. Under a
//! key's lock its counts cannot be overtaken: every claim of the key holds the lock while it
//! decides and records, and finishing jobs only lower a running count.
//!
//! A rate's starts are the claims' `claimed_at`, kept in `tenure_limit_starts`. The claim
//! reads the database's now after taking the locks, so every start recorded before (by a
//! claim that committed before it took them) is at or before that now, and every start it
//! makes is at or after it: "fewer than `max` starts in `(now - per, now]`, plus those it
//! admits" holds for the window ending at its own starts, and so for every window.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, TimeDelta, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};

use super::limits::{JobLimitRow, MAX_LIMIT};
use crate::backend::statement::{row, statement};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::jobs::queue::model::Candidate;
use crate::rows::{At, Count, NullableInt};
use crate::schema::{tenure_job_limits, tenure_limit_keys};
use crate::sql_types::Instant;
use crate::{Result, TenureConnection};

/// The queue's limit, read again under its lock (it may have changed since the pick).
const QUEUE_LOCK: &str =
    "SELECT max_running AS n FROM tenure_queue_limits WHERE queue = ?{for_update}";
/// Writes the queue's limit row under its lock (`Syntax::admission_writes`).
const QUEUE_ADMITS: &str =
    "UPDATE tenure_queue_limits SET admissions = admissions + 1 WHERE queue = ?";
/// The queue's limit, by a plain read.
const QUEUE_LIMIT: &str = "SELECT max_running AS n FROM tenure_queue_limits WHERE queue = ?";
/// The queue's running jobs (`tenure_jobs_queue_state`; on MySQL the claim index).
const QUEUE_RUNNING: &str =
    "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = ? AND state = 'running'";

/// A key's lock if it is free, without waiting (see [`admit`]).
const KEY_TRY_LOCK: &str =
    "SELECT starts_kept AS n FROM tenure_limit_keys WHERE limit_key = ?{skip_locked}";

/// Whether a key has a row (a plain read: 1 or 0).
const KEY_EXISTS: &str = "SELECT COUNT(*) AS n FROM tenure_limit_keys WHERE limit_key = ?";

/// Take a key's lock: an upsert locks its row until commit.
const KEY_LOCK_ON_CONFLICT: &str = "\
    INSERT INTO tenure_limit_keys (limit_key) VALUES (?) \
    ON CONFLICT (limit_key) DO UPDATE SET limit_key = excluded.limit_key";
/// On MySQL the upsert writes the row (its `admissions` counter): a Galera node certifies
/// written rows only, so two nodes' claims of one key conflict at commit.
const KEY_LOCK_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_limit_keys (limit_key) VALUES (?) \
    ON DUPLICATE KEY UPDATE admissions = admissions + 1";

/// A key's running jobs: read through the index of running jobs with limits
/// (`tenure_jobs_limit`), so the cost is the running limited jobs, not the key's waiting ones.
/// With the smallest cap among them: no job starts past it, whatever its own cap.
const KEY_RUNNING: &str = "\
    SELECT COUNT(*) AS n, MIN(l.max_running) AS least FROM tenure_jobs r \
    JOIN tenure_job_limits l ON l.job_id = r.id \
    WHERE r.state = 'running' AND r.limit_key IS NOT NULL \
      AND l.limit_key = ? AND l.max_running IS NOT NULL";

/// A key's newest starts, newest first (the primary key's range, read backwards). A rate of
/// `max` starts per period needs only the newest `max`, whatever the period: if they all
/// fall in its window the window is full, and if not, every start in the window is among
/// them.
const KEY_STARTS: &str = "\
    SELECT started_at AS at FROM tenure_limit_starts \
    WHERE limit_key = ? ORDER BY started_at DESC LIMIT ?";
/// The instant of a key's `MAX_LIMIT`-th newest start (the offset is bound).
const KEY_STARTS_CUTOFF: &str = "\
    SELECT started_at AS at FROM tenure_limit_starts \
    WHERE limit_key = ? ORDER BY started_at DESC LIMIT 1 OFFSET ?";
/// Starts older than every one the newest `MAX_LIMIT` hold: no rate can need them.
const KEY_STARTS_TRIM: &str =
    "DELETE FROM tenure_limit_starts WHERE limit_key = ? AND started_at < ?";
const KEY_STARTS_COUNT: &str = "SELECT COUNT(*) AS n FROM tenure_limit_starts WHERE limit_key = ?";
const KEY_THROTTLE: &str = "\
    UPDATE tenure_limit_keys SET throttled_until = ?, throttled_max = ?, throttled_period_us = ?, \
        starts_kept = ? WHERE limit_key = ?";

/// A key trims its starts to the newest [`MAX_LIMIT`] once it keeps this many (one trim
/// per `MAX_LIMIT` starts: cheap, and never a start any rate could need).
const TRIM_AT: i64 = 2 * MAX_LIMIT as i64;

/// [`KEY_RUNNING`]'s row.
#[derive(QueryableByName)]
struct KeyRunning {
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    least: Option<i32>,
}

/// What a key's candidates ask of it, and what it has.
#[derive(Default)]
struct Key {
    /// Its running jobs (known where a candidate has a concurrency cap on it).
    running: i64,
    /// The smallest cap among its running jobs (and those this claim admitted): no job
    /// starts past it, so a job with a small cap never runs beside more than it allows.
    least_cap: Option<i64>,
    /// Its newest starts (as many as its largest rate's count), oldest first (where a
    /// candidate has a rate).
    starts: Vec<DateTime<Utc>>,
    /// The largest count among its candidates' rates: how many of its newest starts to read.
    newest: i64,
    /// Its rows in `tenure_limit_starts`.
    kept: i64,
    /// The rates its candidates carry, `(max, per_us)`.
    rates: Vec<(i64, i64)>,
    /// Starts this claim admitted (counted at `now` until their instants are known).
    admitted: Vec<i64>,
    /// Its lock could not be taken in key order and another transaction holds it: its
    /// candidates wait for another claim.
    unavailable: bool,
}

/// The candidates admitted, in the candidates' order, and what recording their starts needs.
pub(crate) struct Admission {
    pub ids: Vec<i64>,
    /// The keys whose candidates were refused only because another claimer held them and
    /// they could not be waited for in key order (a wider pick may find others; a claim that
    /// found nothing else takes them first, in a new transaction: [`lock_first`]).
    pub busy_keys: BTreeSet<String>,
    now: DateTime<Utc>,
    /// Keys with a rate, by key.
    rated: BTreeMap<String, Key>,
}

/// Keeps the candidates that may start now (all of them where nothing limits them), in
/// their order, at most `max`. Runs inside the claim's transaction, after the pick.
/// `held`: the keys this transaction has locked already (by an earlier admission in it),
/// to which the keys it locks now are added.
pub(crate) fn admit<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    queue_room: Option<i64>,
    candidates: &[Candidate],
    max: i64,
    held: &mut BTreeSet<String>,
) -> Result<Admission> {
    let max = usize::try_from(max).unwrap_or(0);
    let limited: Vec<i64> = candidates
        .iter()
        .filter(|c| c.limit_key.is_some())
        .map(|c| c.id)
        .collect();
    if limited.is_empty() && queue_room.is_none() {
        return Ok(Admission {
            ids: candidates.iter().take(max).map(|c| c.id).collect(),
            busy_keys: BTreeSet::new(),
            now: DateTime::<Utc>::MIN_UTC,
            rated: BTreeMap::new(),
        });
    }
    // The queue's room (its lock is held since step 0), then the keys' locks by key.
    let mut queue_room = queue_room.unwrap_or(i64::MAX);
    let rows: Vec<JobLimitRow> = if limited.is_empty() {
        Vec::new()
    } else {
        dispatch!(conn, c => {
            tenure_job_limits::table
                .filter(tenure_job_limits::job_id.eq_any(&limited))
                .select(JobLimitRow::as_select())
                .load(c)
        })?
    };
    let mut by_job: HashMap<i64, Vec<&JobLimitRow>> = HashMap::new();
    let mut keys: BTreeMap<String, Key> = BTreeMap::new();
    for row in &rows {
        by_job.entry(row.job_id).or_default().push(row);
        let key = keys.entry(row.limit_key.clone()).or_default();
        if let (Some(max), Some(per)) = (row.rate_max, row.rate_period_us) {
            let rate = (i64::from(max), per);
            if !key.rates.contains(&rate) {
                key.rates.push(rate);
            }
            key.newest = key.newest.max(i64::from(max));
        }
    }
    for (name, key) in keys.iter_mut() {
        let capped = rows
            .iter()
            .any(|r| r.limit_key == *name && r.max_running.is_some());
        // Waiting for a key that sorts before one this transaction holds could close a
        // cycle with a claimer that holds it and waits for ours (on PostgreSQL each such
        // deadlock costs the server's deadlock_timeout: an eight-claimer test over two keys
        // took 52 s instead of 2).
        let in_order = held.contains(name) || held.last().is_none_or(|last| name > last);
        if !in_order && !try_lock_key(conn, name)? {
            key.unavailable = true;
            continue;
        }
        (key.running, key.least_cap) = lock_key(conn, name, capped)?;
        held.insert(name.clone());
    }
    // A claim may have waited for the keys' locks: a queue limit created meanwhile binds it
    // (it holds no lock of the queue's, so a claim under the new limit would not count its
    // jobs). It takes nothing now; the next claim takes the queue's lock at step 0.
    if queue_room == i64::MAX && !keys.is_empty() {
        let created = dispatch!(conn, c => {
            statement(c.syntax().render(QUEUE_LIMIT))
                .bind::<Text, _>(queue)
                .get_result::<NullableInt>(c)
                .optional()
        })?;
        if created.is_some() {
            queue_room = 0;
        }
    }
    let rated = keys.values().any(|k| !k.rates.is_empty() && !k.unavailable);
    // Read after every lock is held: no start recorded by another claim is later.
    let now = if rated {
        crate::database_now(conn)?
    } else {
        DateTime::<Utc>::MIN_UTC
    };
    for (name, key) in keys
        .iter_mut()
        .filter(|(_, k)| !k.rates.is_empty() && !k.unavailable)
    {
        key.kept = dispatch!(conn, c => {
            tenure_limit_keys::table
                .find(name.as_str())
                .select(tenure_limit_keys::starts_kept)
                .first::<i64>(c)
                .optional()
        })?
        .unwrap_or(0);
        let mut starts: Vec<DateTime<Utc>> = dispatch!(conn, c => {
            statement(c.syntax().render(KEY_STARTS))
                .bind::<Text, _>(name.as_str())
                .bind::<BigInt, _>(key.newest)
                .load::<At>(c)
        })?
        .into_iter()
        .map(|row| row.at)
        .collect();
        starts.reverse();
        key.starts = starts;
    }
    let mut ids = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        if queue_room == 0 || ids.len() >= max {
            break;
        }
        let limits = by_job.get(&candidate.id).map(Vec::as_slice).unwrap_or(&[]);
        let fits = limits.iter().all(|limit| {
            let Some(key) = keys.get(&limit.limit_key).filter(|k| !k.unavailable) else {
                return false;
            };
            let running_ok = limit.max_running.is_none_or(|max| {
                let cap = key
                    .least_cap
                    .map_or(i64::from(max), |least| least.min(max.into()));
                key.running < cap
            });
            let rate_ok = match (limit.rate_max, limit.rate_period_us) {
                (Some(max), Some(per)) => {
                    let since = before(now, per);
                    let recent = key.starts.len() - key.starts.partition_point(|s| *s <= since);
                    ((recent + key.admitted.len()) as i64) < i64::from(max)
                }
                _ => true,
            };
            running_ok && rate_ok
        });
        if !fits {
            continue;
        }
        for limit in limits {
            if let Some(key) = keys.get_mut(&limit.limit_key) {
                if let Some(max) = limit.max_running {
                    key.running += 1;
                    let max = i64::from(max);
                    key.least_cap = Some(key.least_cap.map_or(max, |least| least.min(max)));
                }
                if limit.rate_max.is_some() && !key.admitted.contains(&candidate.id) {
                    key.admitted.push(candidate.id);
                }
            }
        }
        queue_room -= 1;
        ids.push(candidate.id);
    }
    let busy_keys = keys
        .iter()
        .filter(|(_, k)| k.unavailable)
        .map(|(name, _)| name.clone())
        .collect();
    keys.retain(|_, k| !k.rates.is_empty() && !k.unavailable);
    Ok(Admission {
        ids,
        busy_keys,
        now,
        rated: keys,
    })
}

/// Claim, step 0: takes the queue's lock if it has a concurrency limit, and says how many
/// more of its jobs may run (`None`: no limit). Taken before the pick locks any job row, so
/// claimers of a limited queue wait here, never in a cycle through job rows (on MariaDB a
/// claim holding skipped index entries, waiting for the queue's lock, deadlocked with one
/// holding the queue's lock and updating those rows). A limit created while a claim is
/// past this step binds it too if it waits for a key's lock (it reads the limit again after
/// them); one created while a claim is between its last lock and its commit binds the
/// claims after it.
pub(crate) fn lock_queue<C: TenureConnection>(conn: &mut C, queue: &str) -> Result<Option<i64>> {
    let max = dispatch!(conn, c => {
        statement(c.syntax().render(QUEUE_LOCK))
            .bind::<Text, _>(queue)
            .get_result::<NullableInt>(c)
            .optional()
    })?;
    let Some(max) = max.and_then(|m| m.n) else {
        return Ok(None);
    };
    dispatch!(conn, c => {
        if c.syntax().admission_writes {
            statement(QUEUE_ADMITS).bind::<Text, _>(queue).execute(c)?;
        }
        Ok::<_, diesel::result::Error>(())
    })?;
    let running = dispatch!(conn, c => {
        statement(c.syntax().render(QUEUE_RUNNING))
            .bind::<Text, _>(queue)
            .get_result::<Count>(c)
    })?;
    Ok(Some((i64::from(max) - running.n).max(0)))
}

/// Takes the locks of `keys` in key order, waiting for each, before the pick: a claim whose
/// candidates were all refused because another claimer held their keys (which it could not
/// wait for then, holding keys sorting after them) runs again holding them first, so it
/// waits in key order where it had to give up. Job rows are picked with SKIP LOCKED, so
/// holding keys while picking closes no cycle through them. The keys join `held`.
pub(crate) fn lock_first<C: TenureConnection>(
    conn: &mut C,
    keys: &BTreeSet<String>,
    held: &mut BTreeSet<String>,
) -> Result<()> {
    for key in keys {
        lock_key(conn, key, false)?;
        held.insert(key.clone());
    }
    Ok(())
}

/// Takes a key's lock if no other transaction holds it, without waiting; false if one does.
/// A key without a row yet (never claimed) is free: [`lock_key`]'s upsert then creates it
/// (waiting only for a claim inserting the same new key at the same moment).
fn try_lock_key<C: TenureConnection>(conn: &mut C, key: &str) -> Result<bool> {
    Ok(dispatch!(conn, c => {
        let locked = statement(c.syntax().render(KEY_TRY_LOCK))
            .bind::<Text, _>(key)
            .get_result::<Count>(c)
            .optional()?;
        if locked.is_some() {
            Ok(true)
        } else {
            statement(KEY_EXISTS)
                .bind::<Text, _>(key)
                .get_result::<Count>(c)
                .map(|row| row.n == 0)
        }
    })?)
}

/// Takes a key's lock and, where `capped`, counts its running jobs and finds the smallest
/// cap among them.
fn lock_key<C: TenureConnection>(
    conn: &mut C,
    key: &str,
    capped: bool,
) -> Result<(i64, Option<i64>)> {
    Ok(dispatch!(conn, c => {
        let syntax = c.syntax();
        let lock = match syntax.upsert {
            Upsert::OnConflictWhere => KEY_LOCK_ON_CONFLICT,
            Upsert::OnDuplicateKey => KEY_LOCK_ON_DUPLICATE_KEY,
        };
        statement(syntax.render(lock)).bind::<Text, _>(key).execute(c)?;
        if capped {
            statement(syntax.render(KEY_RUNNING))
                .bind::<Text, _>(key)
                .get_result::<KeyRunning>(c)
                .map(|row| (row.n, row.least.map(i64::from)))
        } else {
            Ok((0, None))
        }
    })?)
}

/// Records the starts of the admitted jobs with rates (`claimed`: each claimed job's id and
/// `claimed_at`), trims each rated key's starts to what any rate can need, sets its
/// throttle hint, and says how long until the soonest full rate among them has room again.
/// In the claim's transaction, under the keys' locks.
pub(crate) fn record_starts<C: TenureConnection>(
    conn: &mut C,
    admission: &Admission,
    claimed: &[(i64, DateTime<Utc>)],
) -> Result<Option<std::time::Duration>> {
    let claimed_at: HashMap<i64, DateTime<Utc>> = claimed.iter().copied().collect();
    let mut soonest: Option<std::time::Duration> = None;
    for (name, key) in &admission.rated {
        let mut new: Vec<(i64, DateTime<Utc>)> = key
            .admitted
            .iter()
            .filter_map(|id| claimed_at.get(id).map(|at| (*id, *at)))
            .collect();
        new.sort_by_key(|(id, at)| (*at, *id));
        if !new.is_empty() {
            let values = vec!["(?, ?, ?)"; new.len()].join(", ");
            let sql = format!(
                "INSERT INTO tenure_limit_starts (limit_key, started_at, job_id) VALUES {values}"
            );
            let binds = new
                .iter()
                .map(|(id, at)| {
                    row()
                        .bind::<Text, _>(name.as_str())
                        .bind::<Instant, _>(*at)
                        .bind::<BigInt, _>(*id)
                })
                .collect::<Vec<_>>();
            // One shape per row count, up to a claim's batch: not kept prepared past a few.
            let insert = statement(sql);
            let insert = if new.len() > 8 {
                insert.uncached()
            } else {
                insert
            };
            dispatch!(conn, c => insert.bind_rows(binds).execute(c))?;
        }
        let mut starts = key.starts.clone();
        starts.extend(new.iter().map(|(_, at)| *at));
        starts.sort_unstable();
        // The rates the key's starts fill now, each with when it has room again.
        let full: Vec<(DateTime<Utc>, i64, i64)> = key
            .rates
            .iter()
            .filter_map(|&(max, per)| {
                let oldest_that_counts = starts.len().checked_sub(usize::try_from(max).ok()?)?;
                let until =
                    starts[oldest_that_counts].checked_add_signed(TimeDelta::microseconds(per))?;
                (until > admission.now).then_some((until, max, per))
            })
            .collect();
        // The hint: the full rate that frees last. The pick leaves out the jobs whose rate on
        // the key is as strict or stricter (full at least as long); others are decided here.
        let throttle = full.iter().copied().max();
        // When the soonest full rate has room again (a worker may look then).
        let frees = full
            .iter()
            .filter_map(|(until, ..)| (*until - admission.now).to_std().ok())
            .min();
        soonest = match (soonest, frees) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut kept = key.kept + new.len() as i64;
        if kept >= TRIM_AT {
            kept = trim_starts(conn, name)?;
        }
        dispatch!(conn, c => {
            statement(c.syntax().render(KEY_THROTTLE))
                .bind::<Nullable<Instant>, _>(throttle.map(|t| t.0))
                .bind::<Nullable<diesel::sql_types::Integer>, _>(throttle.map(|t| t.1 as i32))
                .bind::<Nullable<BigInt>, _>(throttle.map(|t| t.2))
                .bind::<BigInt, _>(kept)
                .bind::<Text, _>(name.as_str())
                .execute(c)
        })?;
    }
    Ok(soonest)
}

/// Deletes a key's starts older than its newest [`MAX_LIMIT`], and says how many it keeps.
fn trim_starts<C: TenureConnection>(conn: &mut C, key: &str) -> Result<i64> {
    Ok(dispatch!(conn, c => {
        let syntax = c.syntax();
        let cutoff = statement(syntax.render(KEY_STARTS_CUTOFF))
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(i64::from(MAX_LIMIT) - 1)
            .get_result::<At>(c)
            .optional()?;
        if let Some(cutoff) = cutoff {
            statement(syntax.render(KEY_STARTS_TRIM))
                .bind::<Text, _>(key)
                .bind::<Instant, _>(cutoff.at)
                .execute(c)?;
        }
        statement(syntax.render(KEY_STARTS_COUNT))
            .bind::<Text, _>(key)
            .get_result::<Count>(c)
            .map(|count| count.n)
    })?)
}

/// `micros` before `at`, or the earliest instant.
fn before(at: DateTime<Utc>, micros: i64) -> DateTime<Utc> {
    at.checked_sub_signed(TimeDelta::microseconds(micros))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

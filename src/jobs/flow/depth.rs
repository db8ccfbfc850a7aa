//! A queue's depth for monitors that poll often: how many of its jobs wait, how many of
//! those are due, how many run, each counted only up to a bound, so one call costs the same
//! on a table of a thousand jobs or of ten million (and on a bloated one, the same as the
//! live entries up to the bound it walks). [`crate::jobs::stats`] is the whole picture; this is
//! the cheap gauge.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::{Error, Result, TenureConnection};

/// The largest bound [`queue_depth`] counts to.
pub const MAX_DEPTH_BOUND: u32 = 1_000_000;

/// One queue's depth, from [`queue_depth`]. Each count stops at the bound asked for: a count
/// equal to it means "at least that many".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueDepth {
    /// Jobs waiting, due or not (not those blocked on dependencies).
    pub waiting: u64,
    /// Waiting jobs that are due now, on the database's clock.
    pub due: u64,
    /// Jobs claimed and not finished.
    pub running: u64,
}

/// Three bounded counts in one round trip, each an index range of the queue walked until
/// the bound (PostgreSQL and SQLite: the claim index's partial `state = 'waiting'` range
/// and `tenure_jobs_queue_state` for running; MySQL/MariaDB: the claim index, whose prefix is
/// `(queue, state)`).
const DEPTH: &str = "SELECT \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'waiting' LIMIT ?) w) AS waiting, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'waiting' AND due_at <= {now} LIMIT ?) d) AS due, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'running' LIMIT ?) r) AS running";

/// A queue name and a bound, checked; the bound as bound in the statements.
fn checked(queue: &str, bound: u32) -> Result<i64> {
    crate::validate::name("queue", queue)?;
    if bound == 0 || bound > MAX_DEPTH_BOUND {
        return Err(Error::invalid(
            "bound",
            format!("{bound} (1 to {MAX_DEPTH_BOUND})"),
        ));
    }
    Ok(i64::from(bound))
}

/// A count as returned (never negative).
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

#[derive(QueryableByName)]
struct DepthRow {
    #[diesel(sql_type = BigInt)]
    waiting: i64,
    #[diesel(sql_type = BigInt)]
    due: i64,
    #[diesel(sql_type = BigInt)]
    running: i64,
}

/// How many jobs of `queue` wait, are due and run, each counted up to `bound` (1 to
/// [`MAX_DEPTH_BOUND`]). For a gauge polled every fraction of a second: its cost grows with
/// the bound, not with the table.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// for _ in 0..3 {
///     jobs::enqueue(&mut conn, &NewJob::new("mail", "send", vec![]))?;
/// }
/// let depth = jobs::queue_depth(&mut conn, "mail", 2)?;
/// assert_eq!((depth.waiting, depth.due, depth.running), (2, 2, 0)); // "at least 2"
/// # Ok(()) }
/// ```
pub fn queue_depth<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    bound: u32,
) -> Result<QueueDepth> {
    let bound = checked(queue, bound)?;
    let row = dispatch!(conn, c => {
        statement(c.syntax().render(DEPTH))
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .get_result::<DepthRow>(c)
    })?;
    Ok(QueueDepth {
        waiting: count(row.waiting),
        due: count(row.due),
        running: count(row.running),
    })
}

/// A queue's jobs per state, from [`queue_counts`]. Each count stops at the bound asked
/// for: a count equal to it means "at least that many".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueCounts {
    /// Jobs blocked on their dependencies.
    pub blocked: u64,
    /// Jobs waiting, due or not.
    pub waiting: u64,
    /// Waiting jobs that are due now, on the database's clock.
    pub due: u64,
    /// Jobs claimed and not finished.
    pub running: u64,
    /// Jobs parked until something outside answers them.
    pub parked: u64,
    /// Jobs completed (until pruned).
    pub completed: u64,
    /// Jobs dead (until pruned).
    pub dead: u64,
    /// Jobs cancelled (until pruned).
    pub cancelled: u64,
}

/// Eight bounded counts in one round trip, each an index range of `(queue, state)` walked
/// until the bound (PostgreSQL and SQLite: `tenure_jobs_queue_state`, and the claim index for
/// due; MySQL/MariaDB: the claim index, whose prefix is `(queue, state)`).
const COUNTS: &str = "SELECT \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'blocked' LIMIT ?) b) AS blocked, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'waiting' LIMIT ?) w) AS waiting, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'waiting' AND due_at <= {now} LIMIT ?) d) AS due, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'running' LIMIT ?) r) AS running, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'parked' LIMIT ?) p) AS parked, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'completed' LIMIT ?) c) AS completed, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'dead' LIMIT ?) x) AS dead, \
    (SELECT COUNT(*) FROM (SELECT 1 AS x FROM tenure_jobs \
        WHERE queue = ? AND state = 'cancelled' LIMIT ?) n) AS cancelled";

#[derive(QueryableByName)]
struct CountsRow {
    #[diesel(sql_type = BigInt)]
    blocked: i64,
    #[diesel(sql_type = BigInt)]
    waiting: i64,
    #[diesel(sql_type = BigInt)]
    due: i64,
    #[diesel(sql_type = BigInt)]
    running: i64,
    #[diesel(sql_type = BigInt)]
    parked: i64,
    #[diesel(sql_type = BigInt)]
    completed: i64,
    #[diesel(sql_type = BigInt)]
    dead: i64,
    #[diesel(sql_type = BigInt)]
    cancelled: i64,
}

/// How many jobs of `queue` are in each state, each counted up to `bound` (1 to
/// [`MAX_DEPTH_BOUND`]): what a dashboard shows per queue, at a cost that grows with the
/// bound and not with the table ([`crate::jobs::stats`] counts everything).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// for _ in 0..3 {
///     jobs::enqueue(&mut conn, &NewJob::new("mail", "send", vec![]))?;
/// }
/// let counts = jobs::queue_counts(&mut conn, "mail", 1000)?;
/// assert_eq!((counts.waiting, counts.due, counts.completed), (3, 3, 0));
/// # Ok(()) }
/// ```
pub fn queue_counts<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    bound: u32,
) -> Result<QueueCounts> {
    let bound = checked(queue, bound)?;
    let row = dispatch!(conn, c => {
        statement(c.syntax().render(COUNTS))
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(bound)
            .get_result::<CountsRow>(c)
    })?;
    Ok(QueueCounts {
        blocked: count(row.blocked),
        waiting: count(row.waiting),
        due: count(row.due),
        running: count(row.running),
        parked: count(row.parked),
        completed: count(row.completed),
        dead: count(row.dead),
        cancelled: count(row.cancelled),
    })
}

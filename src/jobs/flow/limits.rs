//! Flow control: the limits a job carries (concurrency and rate, per key), queue-wide
//! concurrency limits, and what they look like now. The claim enforces them
//! (`super::admission`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use crate::backend::statement::{row, statement};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::schema::{tenure_job_limits, tenure_queue_limits};
use crate::sql_types::Instant;
use crate::{Error, Result, TenureConnection, validate};

/// The most limits (keys) one job carries.
pub const MAX_LIMITS: usize = 8;
/// The largest concurrency cap or rate count of a limit.
pub const MAX_LIMIT: u32 = 10_000;

/// A limit a job carries ([`crate::jobs::NewJob::with_limit`]): on its key, at most so many
/// running jobs at once ([`Limit::concurrency`]), or at most so many starts in any window of
/// a period ([`Limit::rate`]), or both ([`Limit::and_rate`]). Counted across every worker and
/// process, on the database's clock, and enforced inside the claim: a job whose key has no
/// room stays waiting while other jobs keep moving, and is claimable again when the key has
/// room. A job with several limits starts only when every one of them has room.
///
/// Jobs that share a key share its counts: give them the same limits. Where they differ, no
/// job is ever admitted past its own limits, and a rate holds back only jobs whose own window
/// is full; but a key counts as full at the smallest cap among its running jobs, so a job
/// with a larger cap waits while one with a smaller cap runs.
///
/// A rate counts a key's newest starts, which are kept (the newest 10,000 per key at least,
/// whatever the period), so a rate declared later, or with a longer period, sees them all.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, Limit, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// // At most 10 starts a minute for this customer, at most 2 of them running, and at most
/// // 100 starts a second for the mail provider, whoever the customer.
/// let job = NewJob::new("mail", "send", vec![])
///     .with_limit(Limit::concurrency("customer:42", 2).and_rate(10, Duration::from_secs(60)))
///     .with_limit(Limit::rate("provider", 100, Duration::from_secs(1)));
/// jobs::enqueue(&mut conn, &job)?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Limit {
    pub(crate) key: String,
    pub(crate) max_running: Option<u32>,
    pub(crate) rate: Option<Rate>,
}

/// At most `max` starts in any window of `per` ([`Limit::rate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    /// Starts per window: 1 to [`MAX_LIMIT`].
    pub max: u32,
    /// The window: 1 ms to 366 days.
    pub per: Duration,
}

impl Limit {
    /// At most `max` running jobs with this `key` at once (1 to [`MAX_LIMIT`]).
    ///
    /// ```
    /// let limit = tenure::jobs::Limit::concurrency("account:7", 1);
    /// assert_eq!(limit.key(), "account:7");
    /// ```
    pub fn concurrency(key: impl Into<String>, max: u32) -> Limit {
        Limit {
            key: key.into(),
            max_running: Some(max),
            rate: None,
        }
    }

    /// At most `max` starts of jobs with this `key` in any window of `per`: "10 a minute" is
    /// `rate(key, 10, 60 s)`. A start is a claim (a retry starts again); its instant is the
    /// job's `claimed_at`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let limit = tenure::jobs::Limit::rate("provider", 100, Duration::from_secs(1));
    /// assert_eq!(limit.rate_cap().unwrap().max, 100);
    /// ```
    pub fn rate(key: impl Into<String>, max: u32, per: Duration) -> Limit {
        Limit {
            key: key.into(),
            max_running: None,
            rate: Some(Rate { max, per }),
        }
    }

    /// This limit with a rate as well, on the same key.
    ///
    /// ```
    /// use std::time::Duration;
    /// let limit = tenure::jobs::Limit::concurrency("a", 2).and_rate(5, Duration::from_secs(1));
    /// assert_eq!((limit.max_running(), limit.rate_cap().map(|r| r.max)), (Some(2), Some(5)));
    /// ```
    pub fn and_rate(mut self, max: u32, per: Duration) -> Limit {
        self.rate = Some(Rate { max, per });
        self
    }

    /// This limit with a concurrency cap as well, on the same key.
    ///
    /// ```
    /// use std::time::Duration;
    /// let limit = tenure::jobs::Limit::rate("a", 5, Duration::from_secs(1)).and_concurrency(2);
    /// assert_eq!(limit.max_running(), Some(2));
    /// ```
    pub fn and_concurrency(mut self, max: u32) -> Limit {
        self.max_running = Some(max);
        self
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The concurrency cap, if any.
    pub fn max_running(&self) -> Option<u32> {
        self.max_running
    }

    /// The rate, if any.
    pub fn rate_cap(&self) -> Option<Rate> {
        self.rate
    }

    /// Adds `other`'s caps to this limit of the same key (`other`'s win where both set one).
    pub(crate) fn merge(&mut self, other: Limit) {
        if other.max_running.is_some() {
            self.max_running = other.max_running;
        }
        if other.rate.is_some() {
            self.rate = other.rate;
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate::name("limit key", &self.key)?;
        let in_range = |n: u32| (1..=MAX_LIMIT).contains(&n);
        if let Some(max) = self.max_running
            && !in_range(max)
        {
            return Err(Error::invalid(
                "limit",
                format!("{max} is not between 1 and {MAX_LIMIT}"),
            ));
        }
        if let Some(rate) = self.rate {
            if !in_range(rate.max) {
                return Err(Error::invalid(
                    "rate limit",
                    format!("{} is not between 1 and {MAX_LIMIT}", rate.max),
                ));
            }
            period_micros(rate.per)?;
        }
        Ok(())
    }
}

/// A rate's period in microseconds (1 ms to 366 days).
pub(crate) fn period_micros(per: Duration) -> Result<i64> {
    validate::ttl(per).map_err(|_| {
        Error::invalid(
            "rate limit period",
            format!("{per:?} is not between 1 ms and 366 days"),
        )
    })
}

/// A `tenure_job_limits` row: one limit of one job.
#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = tenure_job_limits)]
pub(crate) struct JobLimitRow {
    pub job_id: i64,
    pub limit_key: String,
    pub max_running: Option<i32>,
    pub rate_max: Option<i32>,
    pub rate_period_us: Option<i64>,
}

/// Rows per multi-row insert of limits: 5 parameters a row.
const LIMIT_ROWS_PER_INSERT: usize = 1000;

/// Writes the limits of newly inserted jobs (`(id, limits)`), in the caller's transaction.
pub(crate) fn record<C: TenureConnection>(conn: &mut C, jobs: &[(i64, &[Limit])]) -> Result<()> {
    let rows: Vec<(i64, &Limit)> = jobs
        .iter()
        .flat_map(|(id, limits)| limits.iter().map(move |limit| (*id, limit)))
        .collect();
    for chunk in rows.chunks(LIMIT_ROWS_PER_INSERT) {
        let values = vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!(
            "INSERT INTO tenure_job_limits \
             (job_id, limit_key, max_running, rate_max, rate_period_us) VALUES {values}"
        );
        let binds = chunk
            .iter()
            .map(|(id, limit)| {
                row()
                    .bind::<BigInt, _>(*id)
                    .bind::<Text, _>(limit.key.as_str())
                    .bind::<Nullable<Integer>, _>(limit.max_running.map(|n| n as i32))
                    .bind::<Nullable<Integer>, _>(limit.rate.map(|r| r.max as i32))
                    .bind::<Nullable<BigInt>, _>(
                        limit
                            .rate
                            .map(|r| i64::try_from(r.per.as_micros()).unwrap_or(i64::MAX)),
                    )
            })
            .collect::<Vec<_>>();
        // One statement shape per row count: the common one (a job's few limits) stays
        // prepared; a bulk chunk does not.
        let insert = statement(sql);
        let insert = if chunk.len() > MAX_LIMITS {
            insert.uncached()
        } else {
            insert
        };
        dispatch!(conn, c => insert.bind_rows(binds).execute(c))?;
    }
    Ok(())
}

/// The limits of a job, as stored (empty for a job without limits, or no such job).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).limit("a", 2))?.id;
/// assert_eq!(jobs::limits_of(&mut conn, id)?[0].max_running(), Some(2));
/// # Ok(()) }
/// ```
pub fn limits_of<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<Limit>> {
    let rows: Vec<JobLimitRow> = dispatch!(conn, c => {
        tenure_job_limits::table
            .filter(tenure_job_limits::job_id.eq(id))
            .order(tenure_job_limits::limit_key)
            .select(JobLimitRow::as_select())
            .load(c)
    })?;
    Ok(rows.into_iter().map(JobLimitRow::into_limit).collect())
}

impl JobLimitRow {
    pub(crate) fn into_limit(self) -> Limit {
        Limit {
            key: self.limit_key,
            max_running: self.max_running.and_then(|n| u32::try_from(n).ok()),
            rate: match (self.rate_max, self.rate_period_us) {
                (Some(max), Some(us)) => Some(Rate {
                    max: u32::try_from(max).unwrap_or(0),
                    per: Duration::from_micros(u64::try_from(us).unwrap_or(0)),
                }),
                _ => None,
            },
        }
    }
}

const SET_QUEUE_LIMIT_ON_CONFLICT: &str = "\
    INSERT INTO tenure_queue_limits (queue, max_running) VALUES (?, ?) \
    ON CONFLICT (queue) DO UPDATE SET max_running = excluded.max_running";
const SET_QUEUE_LIMIT_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_queue_limits (queue, max_running) VALUES (?, ?) \
    ON DUPLICATE KEY UPDATE max_running = VALUES(max_running)";

/// Sets (`Some`) or clears (`None`) a queue-wide concurrency limit: at most `max_running`
/// jobs of `queue` run at once, across every worker and process, whatever their kinds and
/// keys. Enforced inside the claim, under the queue's lock. Takes effect for the next claim;
/// jobs already running keep running. `max_running`: 1 to [`MAX_LIMIT`].
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// jobs::limit_queue(&mut conn, "reports", Some(1))?;
/// for _ in 0..3 {
///     jobs::enqueue(&mut conn, &NewJob::new("reports", "render", vec![]))?;
/// }
/// assert_eq!(jobs::claim(&mut conn, "reports", 10, Duration::from_secs(60))?.len(), 1);
/// assert_eq!(jobs::queue_limits(&mut conn)?, vec![("reports".to_string(), 1)]);
/// # Ok(()) }
/// ```
pub fn limit_queue<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    max_running: Option<u32>,
) -> Result<()> {
    validate::name("queue", queue)?;
    match max_running {
        Some(max) => {
            if !(1..=MAX_LIMIT).contains(&max) {
                return Err(Error::invalid(
                    "queue limit",
                    format!("{max} is not between 1 and {MAX_LIMIT}"),
                ));
            }
            dispatch!(conn, c => {
                let syntax = c.syntax();
                let sql = match syntax.upsert {
                    Upsert::OnConflictWhere => SET_QUEUE_LIMIT_ON_CONFLICT,
                    Upsert::OnDuplicateKey => SET_QUEUE_LIMIT_ON_DUPLICATE_KEY,
                };
                statement(sql)
                    .bind::<Text, _>(queue)
                    .bind::<Integer, _>(max as i32)
                    .execute(c)
            })?;
        }
        None => {
            dispatch!(conn, c => {
                diesel::delete(tenure_queue_limits::table.find(queue)).execute(c)
            })?;
        }
    }
    Ok(())
}

/// Every queue-wide concurrency limit, `(queue, max_running)`, by queue.
pub fn queue_limits<C: TenureConnection>(conn: &mut C) -> Result<Vec<(String, u32)>> {
    let rows: Vec<(String, i32)> = dispatch!(conn, c => {
        tenure_queue_limits::table
            .order(tenure_queue_limits::queue)
            .select((tenure_queue_limits::queue, tenure_queue_limits::max_running))
            .load(c)
    })?;
    Ok(rows
        .into_iter()
        .map(|(queue, max)| (queue, u32::try_from(max).unwrap_or(0)))
        .collect())
}

/// A limit key now ([`key_states`]): how many of its jobs run, and whether its rate window
/// is full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyState {
    /// The key.
    pub key: String,
    /// Its running jobs.
    pub running: i64,
    /// The smallest concurrency cap among its running jobs' limits, if any of them has one.
    pub max_running: Option<i32>,
    /// Until when its rate window is full, if it is now (by the database's clock): it is
    /// throttled, and its waiting jobs start after that.
    pub throttled_until: Option<DateTime<Utc>>,
}

impl KeyState {
    /// Whether its running jobs fill its concurrency cap.
    pub fn saturated(&self) -> bool {
        self.max_running
            .is_some_and(|max| self.running >= i64::from(max))
    }
}

#[derive(QueryableByName)]
struct KeyRunning {
    #[diesel(sql_type = Text)]
    limit_key: String,
    #[diesel(sql_type = BigInt)]
    running: i64,
    #[diesel(sql_type = Nullable<Integer>)]
    max_running: Option<i32>,
}

#[derive(QueryableByName)]
struct KeyThrottle {
    #[diesel(sql_type = Text)]
    limit_key: String,
    #[diesel(sql_type = Instant)]
    throttled_until: DateTime<Utc>,
}

/// Running jobs per key (through the running-limited-jobs index, joined to their limits).
const KEYS_RUNNING: &str = "\
    SELECT l.limit_key AS limit_key, COUNT(*) AS running, MIN(l.max_running) AS max_running \
    FROM tenure_jobs r JOIN tenure_job_limits l ON l.job_id = r.id \
    WHERE r.state = 'running' AND r.limit_key IS NOT NULL \
    GROUP BY l.limit_key ORDER BY l.limit_key LIMIT ?";

/// Keys whose rate window is full now.
const KEYS_THROTTLED: &str = "\
    SELECT limit_key, throttled_until FROM tenure_limit_keys \
    WHERE throttled_until > {now} ORDER BY limit_key LIMIT ?";

/// The limit keys that are busy now: those with running jobs, and those whose rate window is
/// full (throttled), by key, at most `max_keys` of each kind (1 to [`crate::jobs::MAX_BATCH`]).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).limit("a", 1))?;
/// jobs::claim(&mut conn, "q", 10, Duration::from_secs(60))?;
/// let keys = jobs::key_states(&mut conn, 100)?;
/// assert_eq!((keys[0].key.as_str(), keys[0].running, keys[0].saturated()), ("a", 1, true));
/// # Ok(()) }
/// ```
pub fn key_states<C: TenureConnection>(conn: &mut C, max_keys: usize) -> Result<Vec<KeyState>> {
    let max_keys = crate::jobs::queue::check_count(max_keys)?;
    let (running, throttled): (Vec<KeyRunning>, Vec<KeyThrottle>) = dispatch!(conn, c => {
        let syntax = c.syntax();
        let running = statement(syntax.render(KEYS_RUNNING))
            .bind::<BigInt, _>(max_keys)
            .load::<KeyRunning>(c)?;
        let throttled = statement(syntax.render(KEYS_THROTTLED))
            .bind::<BigInt, _>(max_keys)
            .load::<KeyThrottle>(c)?;
        Ok::<_, diesel::result::Error>((running, throttled))
    })?;
    let mut states: Vec<KeyState> = running
        .into_iter()
        .map(|r| KeyState {
            key: r.limit_key,
            running: r.running,
            max_running: r.max_running,
            throttled_until: None,
        })
        .collect();
    for t in throttled {
        match states.iter_mut().find(|s| s.key == t.limit_key) {
            Some(state) => state.throttled_until = Some(t.throttled_until),
            None => states.push(KeyState {
                key: t.limit_key,
                running: 0,
                max_running: None,
                throttled_until: Some(t.throttled_until),
            }),
        }
    }
    states.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(states)
}

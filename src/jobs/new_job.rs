//! What is enqueued: a new job and its options, and what an enqueue reports.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::limits::{Limit, MAX_LIMITS};
use super::{MAX_ATTEMPTS, MAX_PAYLOAD_BYTES};
use crate::{Error, Result, validate};

/// When a new job becomes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// This long after the database's now (zero: at once).
    After(Duration),
    /// At this instant (in the past: at once).
    At(DateTime<Utc>),
}

/// A job to enqueue.
///
/// ```
/// # fn main() -> Result<(), dibs::Error> {
/// use std::time::Duration;
/// use dibs::jobs::NewJob;
/// let job = NewJob::json("mail", "welcome", &serde_json::json!({"to": "ada@example.com"}))?
///     .priority(-1)
///     .delay(Duration::from_secs(30))
///     .max_attempts(5);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    pub(crate) queue: String,
    pub(crate) kind: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) priority: i32,
    pub(crate) due: Due,
    pub(crate) max_attempts: u32,
    pub(crate) dedup_key: Option<String>,
    pub(crate) limits: Vec<Limit>,
}

impl NewJob {
    /// A job of `kind` on `queue` with a payload of bytes, due at once, priority 0, at most 25
    /// attempts.
    pub fn new(
        queue: impl Into<String>,
        kind: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        NewJob {
            queue: queue.into(),
            kind: kind.into(),
            payload: payload.into(),
            priority: 0,
            due: Due::After(Duration::ZERO),
            max_attempts: 25,
            dedup_key: None,
            limits: Vec::new(),
        }
    }

    /// A job whose payload is `value` as JSON.
    pub fn json<T: serde::Serialize + ?Sized>(
        queue: impl Into<String>,
        kind: impl Into<String>,
        value: &T,
    ) -> Result<Self> {
        let payload = serde_json::to_vec(value)
            .map_err(|e| Error::invalid("payload", format!("cannot be written as JSON: {e}")))?;
        Ok(NewJob::new(queue, kind, payload))
    }

    /// Lower runs first (default 0). Within a queue, claims take jobs by priority, then due
    /// time, then id.
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Due this long after the database's now.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.due = Due::After(delay);
        self
    }

    /// Due at this instant: from year 1 to year 9999 (what every backend stores; a later
    /// instant meant as "never", such as `DateTime::<Utc>::MAX_UTC`, is refused with
    /// [`Error::InvalidInput`] when the job is enqueued).
    pub fn at(mut self, at: DateTime<Utc>) -> Self {
        self.due = Due::At(at);
        self
    }

    /// How many runs the job may have before it is dead (1 to 1000; default 25).
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// A deduplication key: while a job of the same queue with this key is waiting or
    /// running (retries included), enqueueing this one returns that job instead
    /// ([`Enqueued::existing`]). Byte-exact, 1 to 255 bytes.
    pub fn dedup_key(mut self, key: impl Into<String>) -> Self {
        self.dedup_key = Some(key.into());
        self
    }

    /// A concurrency limit: at most `max` jobs with this `key` run at once, across every
    /// worker and process (per customer, per account). Enforced inside the claim: a
    /// saturated key is skipped and other jobs keep moving. `max`: 1 to 10,000. Shorthand
    /// for [`with_limit`](Self::with_limit)`(Limit::concurrency(key, max))`.
    pub fn limit(self, key: impl Into<String>, max: u32) -> Self {
        self.with_limit(Limit::concurrency(key, max))
    }

    /// A rate limit: at most `max` starts of jobs with this `key` in any window of `per`,
    /// across every worker and process. Shorthand for
    /// [`with_limit`](Self::with_limit)`(Limit::rate(key, max, per))`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let job = dibs::jobs::NewJob::new("hooks", "deliver", vec![])
    ///     .rate_limit("customer:42", 10, Duration::from_secs(60));
    /// ```
    pub fn rate_limit(self, key: impl Into<String>, max: u32, per: Duration) -> Self {
        self.with_limit(Limit::rate(key, max, per))
    }

    /// Adds a limit ([`Limit`]): the job starts only when every one of its limits has room.
    /// A second limit on the same key adds its caps to the first. At most
    /// [`MAX_LIMITS`](super::MAX_LIMITS) keys.
    pub fn with_limit(mut self, limit: Limit) -> Self {
        match self.limits.iter_mut().find(|l| l.key == limit.key) {
            Some(same_key) => same_key.merge(limit),
            None => self.limits.push(limit),
        }
        self
    }

    /// The job's limits, in the order given.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// `dibs_jobs.limit_key` and `limit_max`: the first limit's key and concurrency cap
    /// (the key also says the job has limits in `dibs_job_limits`).
    pub(crate) fn first_limit(&self) -> (Option<&str>, Option<i32>) {
        match self.limits.first() {
            Some(limit) => (
                Some(limit.key.as_str()),
                limit.max_running.map(|n| n as i32),
            ),
            None => (None, None),
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.limits.len() > MAX_LIMITS {
            return Err(Error::invalid(
                "limits",
                format!("{} keys, the most is {MAX_LIMITS}", self.limits.len()),
            ));
        }
        for limit in &self.limits {
            limit.validate()?;
        }
        validate::name("queue", &self.queue)?;
        if let Some(key) = &self.dedup_key {
            validate::name("dedup key", key)?;
        }
        validate::name("kind", &self.kind)?;
        if self.payload.len() > MAX_PAYLOAD_BYTES {
            return Err(Error::invalid(
                "payload",
                format!(
                    "is {} bytes, the limit is {MAX_PAYLOAD_BYTES}",
                    self.payload.len()
                ),
            ));
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS {
            return Err(Error::invalid(
                "max_attempts",
                format!("{} is not between 1 and {MAX_ATTEMPTS}", self.max_attempts),
            ));
        }
        match self.due {
            Due::After(delay) if delay > validate::MAX_TTL => {
                return Err(Error::invalid(
                    "delay",
                    format!("{delay:?} is longer than 366 days"),
                ));
            }
            Due::At(at) => validate::instant("due at", at)?,
            Due::After(_) => {}
        }
        Ok(())
    }

    /// The due time as SQL parameters: an instant, or a delay in microseconds.
    pub(crate) fn due_params(&self) -> (Option<DateTime<Utc>>, i64) {
        match self.due {
            Due::At(at) => (Some(at), 0),
            // Bounded by validate(): at most 366 days.
            Due::After(delay) => (None, i64::try_from(delay.as_micros()).unwrap_or(i64::MAX)),
        }
    }
}

/// What [`super::enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Enqueued {
    /// The job's id: the new job's, or the live job's that has the same dedup key.
    pub id: i64,
    /// True when a live job with the same queue and dedup key already existed, and no new
    /// job was made.
    pub existing: bool,
}

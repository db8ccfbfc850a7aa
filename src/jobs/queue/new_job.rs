//! What is enqueued: a new job and its options, and what an enqueue reports.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{MAX_ATTEMPTS, MAX_PAYLOAD_BYTES};
use crate::jobs::flow::limits::{Limit, MAX_LIMITS};
use crate::jobs::flow::sequences::SequenceFailure;
use crate::jobs::workflows::{MAX_DEPENDENCIES, RunWhen};
use crate::{Error, Result, validate};

/// When a new job becomes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// This long after the database's now (zero: at once).
    After(Duration),
    /// At this instant (in the past: at once).
    At(DateTime<Utc>),
}

/// Which finished jobs a dedup window covers ([`NewJob::dedup_window`]).
///
/// ```
/// use std::time::Duration;
/// use tenure::jobs::{DedupOver, NewJob};
/// // A report that died may be asked for again at once; one that completed, not for a day.
/// let job = NewJob::new("reports", "monthly", vec![])
///     .dedup_key("2025-01")
///     .dedup_window(Duration::from_secs(86_400), DedupOver::Completed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DedupOver {
    /// Completed jobs only: a job that died or was cancelled can be enqueued again at once.
    Completed,
    /// Any final state: completed, dead or cancelled.
    AnyFinal,
}

/// What an enqueue does to the live (waiting or running) job that already has its queue and
/// dedup key ([`NewJob::on_duplicate`]). Either way no new job is made, the live job's id
/// comes back ([`Enqueued::existing`]) and its `dedup_hits` counts the enqueue. A running
/// job is never changed, whatever the mode ([`Enqueued::updated`] is false then).
///
/// ```
/// use std::time::Duration;
/// use tenure::jobs::{NewJob, OnDuplicate};
/// // A reminder: whoever asks for it first sets the earliest time it goes out.
/// let job = NewJob::new("mail", "reminder", vec![])
///     .dedup_key("user-7")
///     .delay(Duration::from_secs(600))
///     .on_duplicate(OnDuplicate::KeepEarlierDue);
/// assert_eq!(OnDuplicate::default(), OnDuplicate::Keep);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OnDuplicate {
    /// Leave the live job as it is (the default). The modes below change only a waiting job
    /// of the same kind: a key shared by two kinds never hands one kind's payload to the
    /// other's handler (a duplicate of another kind is folded unchanged).
    #[default]
    Keep,
    /// Debounce: a waiting job takes this enqueue's payload and due time.
    Replace,
    /// A waiting job's due time becomes the earlier of its own and this enqueue's; its
    /// payload stays.
    KeepEarlierDue,
}

/// A job to enqueue.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::NewJob;
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
    pub(crate) dedup_window: Option<(Duration, DedupOver)>,
    pub(crate) on_duplicate: OnDuplicate,
    /// The jobs it waits for, sorted, without repeats.
    pub(crate) dependencies: Vec<i64>,
    pub(crate) run_when: RunWhen,
    /// Its workflow (set by [`crate::jobs::enqueue_workflow`], or taken from a dependency's).
    pub(crate) workflow_id: Option<i64>,
    /// Its sequence key, and what the jobs after it do if it ends dead or cancelled.
    pub(crate) sequence: Option<(String, SequenceFailure)>,
    /// Its tenant for fair claiming.
    pub(crate) fair_key: Option<String>,
    /// Its place in its queue's virtual time, given in the enqueue's transaction
    /// (`flow::fairness::stamped`); 0 until then, and for a job without a fair key.
    pub(crate) fair_stamp: i64,
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
            dedup_window: None,
            on_duplicate: OnDuplicate::Keep,
            dependencies: Vec::new(),
            run_when: RunWhen::AllCompleted,
            workflow_id: None,
            sequence: None,
            fair_key: None,
            fair_stamp: 0,
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

    /// A dedup window: the dedup key also covers jobs of the queue with this key that
    /// finished (`over`: completed only, or in any final state) less than `window` ago, on
    /// the database's clock. Enqueueing while such a job exists returns it
    /// ([`Enqueued::existing`], its `dedup_hits` counted up) and makes nothing; after the
    /// window a new job is made. A live job with the key still comes first (see
    /// [`NewJob::on_duplicate`]).
    ///
    /// Needs a [`dedup_key`](NewJob::dedup_key); `window`: 1 ms to 366 days. Otherwise the
    /// enqueue is refused with [`Error::InvalidInput`] and writes nothing.
    ///
    /// Retention: a job remembers the largest window of the enqueues folded into it
    /// (`tenure_jobs.dedup_window_micros`), and [`prune`](crate::jobs::prune) keeps it until
    /// `finished_at + window` has passed, whatever its policy; then the policy applies. So
    /// give every enqueue of a key the same window: a later enqueue with a *longer* window
    /// than the finished job was kept for may find it already pruned.
    ///
    /// Concurrency: enqueues of a key racing each other and the twin's finish never make two
    /// jobs inside a window, on every backend, when the enqueue runs on its own or in a READ
    /// COMMITTED transaction (tenure's own, [`crate::transaction`]); a caller's REPEATABLE READ
    /// or SERIALIZABLE snapshot can miss a twin that finished after it was taken.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// use std::time::Duration;
    /// use tenure::jobs::{self, DedupOver, NewJob};
    /// let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// tenure::run_migrations(&mut conn)?;
    /// // A webhook delivery: once per id, even when it is redelivered after it completed.
    /// let job = NewJob::new("hooks", "deliver", b"evt_1".to_vec())
    ///     .dedup_key("evt_1")
    ///     .dedup_window(Duration::from_secs(3600), DedupOver::Completed);
    /// let first = jobs::enqueue(&mut conn, &job)?;
    /// let claimed = jobs::claim(&mut conn, "hooks", 1, Duration::from_secs(60))?;
    /// jobs::complete(&mut conn, &[claimed[0].claim()])?;
    /// let again = jobs::enqueue(&mut conn, &job)?;
    /// assert_eq!((again.id, again.existing), (first.id, true));
    /// // Without a key a window means nothing: refused.
    /// let keyless = NewJob::new("hooks", "deliver", vec![])
    ///     .dedup_window(Duration::from_secs(60), DedupOver::AnyFinal);
    /// assert!(jobs::enqueue(&mut conn, &keyless).unwrap_err().is_invalid_input());
    /// # Ok(()) }
    /// ```
    pub fn dedup_window(mut self, window: Duration, over: DedupOver) -> Self {
        self.dedup_window = Some((window, over));
        self
    }

    /// What this enqueue does to a live job with the same queue and dedup key (default
    /// [`OnDuplicate::Keep`]): decided inside the insert, by the unique index over live
    /// jobs, so concurrent enqueuers of a key apply one after the other. Needs a
    /// [`dedup_key`](NewJob::dedup_key) unless it is `Keep` ([`Error::InvalidInput`]).
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// use std::time::Duration;
    /// use tenure::jobs::{self, NewJob, OnDuplicate};
    /// let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// tenure::run_migrations(&mut conn)?;
    /// // Debounce: reindex once, 30 s after the last change, with the last change's payload.
    /// let reindex = |v: &str| NewJob::new("search", "reindex", v.as_bytes().to_vec())
    ///     .dedup_key("doc-7")
    ///     .delay(Duration::from_secs(30))
    ///     .on_duplicate(OnDuplicate::Replace);
    /// let first = jobs::enqueue(&mut conn, &reindex("v1"))?;
    /// let second = jobs::enqueue(&mut conn, &reindex("v2"))?;
    /// assert_eq!((second.id, second.existing, second.updated), (first.id, true, true));
    /// assert_eq!(jobs::get(&mut conn, first.id)?.unwrap().payload, b"v2");
    /// # Ok(()) }
    /// ```
    pub fn on_duplicate(mut self, mode: OnDuplicate) -> Self {
        self.on_duplicate = mode;
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
    /// let job = tenure::jobs::NewJob::new("hooks", "deliver", vec![])
    ///     .rate_limit("customer:42", 10, Duration::from_secs(60));
    /// ```
    pub fn rate_limit(self, key: impl Into<String>, max: u32, per: Duration) -> Self {
        self.with_limit(Limit::rate(key, max, per))
    }

    /// Adds a limit ([`Limit`]): the job starts only when every one of its limits has room.
    /// A second limit on the same key adds its caps to the first. At most
    /// [`MAX_LIMITS`] keys.
    pub fn with_limit(mut self, limit: Limit) -> Self {
        match self.limits.iter_mut().find(|l| l.key == limit.key) {
            Some(same_key) => same_key.merge(limit),
            None => self.limits.push(limit),
        }
        self
    }

    /// Waits for these jobs (which must exist, in this transaction or committed): the job
    /// is [`JobState::Blocked`](crate::jobs::JobState::Blocked) until they finish as
    /// [`NewJob::run_when`] asks (by default: all completed; cancelled if one dies or is
    /// cancelled). Adds to the dependencies given before; repeats are harmless. At most
    /// [`MAX_DEPENDENCIES`]; not with a dedup key. The job joins the
    /// workflow of its first dependency that has one. Read their results with
    /// [`crate::jobs::dependency_results`].
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// use std::time::Duration;
    /// use tenure::jobs::{self, JobState, NewJob, Outcome};
    /// let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// tenure::run_migrations(&mut conn)?;
    /// let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))?.id;
    /// let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]).depends_on([a]))?.id;
    /// let claimed = jobs::claim(&mut conn, "q", 10, Duration::from_secs(60))?;
    /// assert_eq!(claimed.len(), 1); // only a: b is blocked
    /// jobs::complete(&mut conn, &[claimed[0].claim()])?;
    /// assert_eq!(jobs::get(&mut conn, b)?.unwrap().state, JobState::Waiting);
    /// # Ok(()) }
    /// ```
    pub fn depends_on(mut self, ids: impl IntoIterator<Item = i64>) -> Self {
        self.dependencies.extend(ids);
        self.dependencies.sort_unstable();
        self.dependencies.dedup();
        self
    }

    /// When the job runs, given its dependencies (default [`RunWhen::AllCompleted`]).
    pub fn run_when(mut self, run_when: RunWhen) -> Self {
        self.run_when = run_when;
        self
    }

    /// Runs in order with the other jobs of sequence `key`: after the job enqueued before it
    /// with this key has completed (enqueue order: the order in which the enqueues of the key
    /// commit), one at a time. A job of the key that retries, snoozes or waits for its due
    /// time holds the rest back. If one ends dead or cancelled, the rest wait until it
    /// completes after all or an operator lets them go on ([`SequenceFailure::Hold`], the
    /// default; see [`NewJob::sequence_failure`]). Keys are names (1 to 255 bytes) shared
    /// across queues. Not with [`NewJob::depends_on`] nor a dedup key ([`crate::Error::InvalidInput`]).
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// use std::time::Duration;
    /// use tenure::jobs::{self, JobState, NewJob};
    /// let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// tenure::run_migrations(&mut conn)?;
    /// let first = jobs::enqueue(&mut conn, &NewJob::new("sync", "a", vec![]).sequence("account-7"))?.id;
    /// let second = jobs::enqueue(&mut conn, &NewJob::new("sync", "b", vec![]).sequence("account-7"))?.id;
    /// let claimed = jobs::claim(&mut conn, "sync", 10, Duration::from_secs(60))?;
    /// assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![first]);
    /// jobs::complete(&mut conn, &[claimed[0].claim()])?;
    /// assert_eq!(jobs::get(&mut conn, second)?.unwrap().state, JobState::Waiting);
    /// # Ok(()) }
    /// ```
    pub fn sequence(mut self, key: impl Into<String>) -> Self {
        let failure = self.sequence.map(|(_, f)| f).unwrap_or_default();
        self.sequence = Some((key.into(), failure));
        self
    }

    /// What the jobs after this one in its sequence do if it ends dead or cancelled (default
    /// [`SequenceFailure::Hold`]). Needs [`NewJob::sequence`].
    pub fn sequence_failure(mut self, failure: SequenceFailure) -> Self {
        if let Some((_, f)) = self.sequence.as_mut() {
            *f = failure;
        } else {
            self.sequence = Some((String::new(), failure));
        }
        self
    }

    /// Claims share its queue fairly between `key` and the other tenants with jobs waiting
    /// in it: round-robin by default, or by weight ([`crate::jobs::set_fair_weight`]), within
    /// a priority. Each job takes its tenant's next place in the queue's virtual time
    /// (start-time fair queueing): a tenant with 50,000 jobs waiting and one that enqueues a
    /// job after them take turns, so the second waits for about one job per tenant, not for
    /// the 50,000. Work-conserving: a lone tenant gets all the capacity. A job keeps its
    /// place through retries and snoozes. Keys are names (1 to 255 bytes), per queue. Jobs
    /// without a fair key in the same queue come first within their priority.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// use std::time::Duration;
    /// use tenure::jobs::{self, NewJob};
    /// let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// tenure::run_migrations(&mut conn)?;
    /// let burst: Vec<_> = (0..100).map(|_| NewJob::new("sync", "pull", vec![]).fair_key("tenant-a")).collect();
    /// jobs::enqueue_many(&mut conn, &burst)?;
    /// let single = jobs::enqueue(&mut conn, &NewJob::new("sync", "pull", vec![]).fair_key("tenant-b"))?.id;
    /// let claimed = jobs::claim(&mut conn, "sync", 3, Duration::from_secs(60))?;
    /// assert!(claimed.iter().any(|job| job.id == single));
    /// # Ok(()) }
    /// ```
    pub fn fair_key(mut self, key: impl Into<String>) -> Self {
        self.fair_key = Some(key.into());
        self
    }

    /// Its sequence key, if it has one ([`NewJob::sequence`]).
    pub fn sequence_key(&self) -> Option<&str> {
        self.sequence
            .as_ref()
            .map(|(key, _)| key.as_str())
            .filter(|k| !k.is_empty())
    }

    /// The jobs it waits for.
    pub fn dependencies(&self) -> &[i64] {
        &self.dependencies
    }

    /// The state it is inserted in, its stripes and `run_when` (a job with dependencies is
    /// blocked until they are settled).
    pub(crate) fn dependency_params(&self) -> (&'static str, Option<&'static str>, Option<i32>) {
        if self.dependencies.is_empty() {
            ("waiting", None, None)
        } else {
            (
                "blocked",
                Some(self.run_when.as_str()),
                Some(crate::jobs::workflows::dependencies::stripes_for(
                    self.dependencies.len(),
                )),
            )
        }
    }

    /// The job's limits, in the order given.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// `tenure_jobs.limit_key` and `limit_max`: the first limit's key and concurrency cap
    /// (the key also says the job has limits in `tenure_job_limits`).
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
        if self.dependencies.len() > MAX_DEPENDENCIES {
            return Err(Error::invalid(
                "dependencies",
                format!(
                    "{} jobs, the most is {MAX_DEPENDENCIES}",
                    self.dependencies.len()
                ),
            ));
        }
        if !self.dependencies.is_empty() && self.dedup_key.is_some() {
            return Err(Error::invalid(
                "dependencies",
                "a job with dependencies cannot have a dedup key",
            ));
        }
        if let Some(key) = &self.dedup_key {
            validate::name("dedup key", key)?;
        }
        if let Some((key, _)) = &self.sequence {
            if key.is_empty() {
                return Err(Error::invalid("sequence_failure", "needs a sequence key"));
            }
            validate::name("sequence key", key)?;
            if !self.dependencies.is_empty() {
                return Err(Error::invalid(
                    "sequence",
                    "a job of a sequence cannot have dependencies of its own",
                ));
            }
            if self.dedup_key.is_some() {
                return Err(Error::invalid(
                    "sequence",
                    "a job of a sequence cannot have a dedup key",
                ));
            }
        }
        if let Some(key) = &self.fair_key {
            validate::name("fair key", key)?;
        }
        if self.dedup_key.is_none() {
            if self.dedup_window.is_some() {
                return Err(Error::invalid("dedup_window", "needs a dedup key"));
            }
            if self.on_duplicate != OnDuplicate::Keep {
                return Err(Error::invalid("on_duplicate", "needs a dedup key"));
            }
        }
        if let Some((window, _)) = self.dedup_window {
            if window < Duration::from_millis(1) || window > validate::MAX_TTL {
                return Err(Error::invalid(
                    "dedup_window",
                    format!("{window:?} is not between 1 ms and 366 days"),
                ));
            }
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

    /// The dedup window in microseconds, if any (bounded by validate(): at most 366 days).
    pub(crate) fn window_micros(&self) -> Option<i64> {
        self.dedup_window
            .map(|(window, _)| i64::try_from(window.as_micros()).unwrap_or(i64::MAX))
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

/// What [`crate::jobs::enqueue`] did.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, Enqueued, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let first = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).dedup_key("a"))?;
/// let again = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).dedup_key("a"))?;
/// assert_eq!(again, Enqueued { id: first.id, existing: true, updated: false });
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Enqueued {
    /// The job's id: the new job's, or the live job's that has the same dedup key. Ids only
    /// grow but may have gaps: an enqueue folded into an existing job can use one up (a
    /// database sequence gives back no value).
    pub id: i64,
    /// True when a job with the same queue and dedup key already existed (a live one, or
    /// one finished within the [`dedup window`](NewJob::dedup_window)), and no new job was
    /// made.
    pub existing: bool,
    /// True when that job was waiting and this enqueue's [`OnDuplicate`] mode was applied
    /// to it: its payload and due time replaced ([`OnDuplicate::Replace`]), or its due time
    /// set to the earlier of the two ([`OnDuplicate::KeepEarlierDue`], which leaves it as it
    /// was when its own was earlier). False for a new job, with [`OnDuplicate::Keep`], for a
    /// running job (never changed) and for a finished one.
    pub updated: bool,
}

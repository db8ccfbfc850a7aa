//! The fragments of SQL that differ per backend ([`Syntax`]), and the statements rendered
//! with them, once per backend ([`Syntax::render`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::{OnceLock, PoisonError, RwLock};

/// How an upsert that may leave an existing row alone is spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Upsert {
    /// `INSERT ... ON CONFLICT (key) DO UPDATE SET ... WHERE ...` (PostgreSQL, SQLite).
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    OnConflictWhere,
    /// `INSERT ... ON DUPLICATE KEY UPDATE col = IF(...)` (MySQL/MariaDB: no WHERE there).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    OnDuplicateKey,
}

/// The fragments of SQL that differ per backend. Statements are written once as templates
/// with `?` parameters (numbered by diesel where the backend wants `$1`: see
/// [`statement`](super::statement)(super::statement)), `{now}` (the database clock) and `{now+ttl}` (the clock plus a
/// parameter in microseconds), and rendered per backend by [`Syntax::render`].
#[derive(Debug)]
pub(crate) struct Syntax {
    /// The database clock, an [`Instant`](crate::sql_types::Instant).
    pub now: &'static str,
    /// The clock plus `?` microseconds (a BIGINT parameter).
    pub now_plus_micros: &'static str,
    /// `{grant_times}`: in a lease take's `ON CONFLICT ... DO UPDATE SET`, the grant's
    /// `acquired_at` and `expires_at`, read once the statement holds the row (the inserted
    /// values are from the statement's start, which is before any wait for the row lock).
    pub grant_times: &'static str,
    /// How conditional upserts are written.
    pub upsert: Upsert,
    /// Whether `UPDATE ... RETURNING` exists (not on MariaDB, whose RETURNING is for `INSERT`
    /// and `DELETE`; every backend's inserts return their rows).
    pub returning: bool,
    /// Appended to a SELECT that locks the rows it reads: `{for_update}` ("" on SQLite, where
    /// the IMMEDIATE transaction already holds the database's write lock).
    pub for_update: &'static str,
    /// `{skip_locked}`: like `for_update`, skipping rows other transactions have locked.
    pub skip_locked: &'static str,
    /// `{random_token}`: 16 random bytes made by the database, for tokens made in bulk.
    pub random_token: &'static str,
    /// A statement that wakes idle workers of the queue bound to it (PostgreSQL NOTIFY; sent
    /// at commit, so a rolled-back enqueue wakes nobody).
    pub notify_queue: Option<&'static str>,
    /// A statement that wakes the waiters of the lease bound to it, in other processes
    /// (PostgreSQL NOTIFY, sent at commit).
    pub notify_lease: Option<&'static str>,
    /// [`Syntax::notify_queue`] for a transaction of its own, after an enqueue committed:
    /// its commit need not wait for the log to reach the disk (a crash can lose a wake-up,
    /// never a job).
    pub notify_queue_unflushed: Option<&'static str>,
    /// The same wake-up as a column of an insert's RETURNING list (empty where there is
    /// none), so a single enqueue is one round trip.
    pub notify_in_returning: &'static str,
    /// `{claim_from}`: where a claim picks waiting jobs, as `c`, with their job rows as `j`
    /// where those are another table: on the servers the ready ring (`tenure_ready`, see
    /// docs/storage-design.md) joined to the jobs it lists (MySQL: through the ring's claim
    /// index, pinned, and in that join order, so its locking read follows the index order);
    /// on SQLite `tenure_jobs` itself, through the claim index (pinned: the planner might
    /// take a skip-scan plus a sort).
    pub claim_from: &'static str,
    /// `{claim_kind_from}`: the same for a claim of some kinds, which the kind-leading claim
    /// index serves (one range per kind, in claim order within it).
    pub claim_kind_from: &'static str,
    /// The statement that writes the ready entries of the jobs a multi-row insert made (ids
    /// bound as `{ids}`), where the ring's insert trigger is per row (MariaDB: no statement
    /// triggers) and passes by rows inserted with `ready_entry_by_insert` (migration
    /// `tenure-0055`); `None` where the ring's trigger runs once a statement (PostgreSQL) or
    /// there is no ring (SQLite).
    pub ready_entries: Option<&'static str>,
    /// `{fair_waiting_from}`: a FROM and the start of its WHERE that give the waiting fair
    /// jobs as `c`, through an index on (queue, fair key, priority, stamp): the ring on the
    /// servers, the jobs' partial index on SQLite (a fair enqueue reads its tenant's last
    /// waiting turn there).
    pub fair_waiting_from: &'static str,
    /// `{fair_key_is}`: the condition that `c.fair_key` is the key bound twice. PostgreSQL: a
    /// range of one value, which keeps the read's `ORDER BY c.fair_key` (an equality drops
    /// it): without statistics (autovacuum off) the planner took the claim index and
    /// filtered the tenant's entries out of every other tenant's, 11 ms behind 50,000 of
    /// them against 0.08 ms through the tenants' index. Elsewhere an equality (the index is
    /// named).
    pub fair_key_is: &'static str,
    /// `{keyed_jobs}`: the table a job with a dedup key is inserted into, named so that the
    /// upsert's `tenure_jobs.` columns still mean the row (PostgreSQL: the `kept` partition,
    /// which holds the key's unique index; elsewhere `tenure_jobs`).
    pub keyed_jobs: &'static str,
    /// `{pick_slot}`: the job's slot as the pick reads it (PostgreSQL: the entry's
    /// `job_slot`; elsewhere there are no slots: 0).
    pub pick_slot: &'static str,
    /// Whether `tenure_jobs` is in job slots (PostgreSQL): the hot path's statements name
    /// the slot's partition ([`Syntax::slot_jobs`]).
    pub job_slots: bool,
    /// `{claim_waiting}`: the pick's condition that the job waits (`c.state` where `c` is
    /// the jobs table, `j.state` beside MySQL's ring, where a locking read sees the job's
    /// latest version). Empty on PostgreSQL: an entry exists exactly while its job waits
    /// (the ring's triggers change both in one transaction, and a job changed since the
    /// pick's snapshot had its entry deleted, which the lock finds), and a `j.state`
    /// condition made the planner read the jobs through their partial claim index, every
    /// dead entry of it included, instead of by their primary key.
    pub claim_waiting: &'static str,
    /// `{claim_lock}`: the pick's locking clause, skipping rows other claimers hold: on
    /// PostgreSQL the ring's entries only (the mark locks the jobs, `{claim_mark_ids}`); on
    /// MySQL/MariaDB both the entry and the job's row, so that a claim never waits for a job
    /// another transaction changes (which waits, through the ring's trigger, for its entry);
    /// nothing on SQLite (the IMMEDIATE transaction has the write lock).
    pub claim_lock: &'static str,
    /// `{claim_mark_ids}`: the claim's mark's condition on the picked ids (`{ids}`). On
    /// PostgreSQL the pick locked their entries only: the mark locks each job itself, still
    /// waiting, skipping any another transaction holds (`FOR NO KEY UPDATE SKIP LOCKED`: a
    /// cancel, a fold or the ager locks the job first and then waits, through the ring's
    /// trigger, for the entry this claim holds; waiting here would deadlock, and a key-share
    /// lock, which an insert referencing the job takes, does not conflict). A job skipped
    /// keeps its entry and is not claimed. The locked ids are an array read once (an
    /// `IN (subquery)` semi-join cost the drain a tenth). Elsewhere `id IN {ids}`: the pick
    /// locked the jobs.
    pub claim_mark_ids: &'static str,
    /// Where the picked entries leave, on PostgreSQL (whose ring triggers skip waiting to
    /// running): the claim's mark (`UPDATE ... RETURNING`, in place of `{marked}`) wrapped
    /// in a statement that also deletes the entries of the jobs it marked, in the same round
    /// trip. None elsewhere: MySQL's row triggers delete them as the mark changes each job
    /// (they fire per row anyway); SQLite picks the jobs themselves.
    pub claim_forget: Option<&'static str>,
    /// `{greatest}`: the larger of two values (SQLite's two-argument MAX, GREATEST on the
    /// servers).
    pub greatest: &'static str,
    /// An ORDER BY tiebreak for rows of one table written at one instant of
    /// [`Syntax::now`] (today `tenure_steps`): SQLite's clock reads milliseconds, so rows of
    /// consecutive quick transactions share one, and its rowid keeps their insertion order;
    /// the servers' clocks read microseconds at each transaction's start, so a later
    /// transaction's row is later, and the name only orders rows of one transaction.
    pub insertion_tiebreak: &'static str,
    /// `{window_over}`: a finished job's dedup window is over by the database's clock
    /// (`finished_at + dedup_window_micros <= now`).
    pub window_over: &'static str,
    /// SQLite: a worker's lock (a file lock) is freed only when its process ends, so a free
    /// lock alone says it died. On a server a session can end while its process lives.
    pub lock_ends_with_process: bool,
    /// Whether a claim that decides under a concurrency limit writes the limit's row (its
    /// `admissions` counter), not only locks it: on MySQL/MariaDB, where a Galera node's row
    /// locks are its own and only written rows are certified at commit, so two nodes' claims
    /// of one limit must conflict there (one fails with 1213 and is retried). On a single
    /// server the write takes the same lock the read would.
    pub admission_writes: bool,
    /// `{in_transaction}`: a condition that holds only inside an explicit transaction, for
    /// the writes that must never run on their own. MySQL/MariaDB: a Galera node that rolls a
    /// transaction back between two statements (a conflict with another node's commit)
    /// reports it to one statement only; should that error be lost on the way, the next
    /// statements would each commit on their own (seen: a claim's mark committed while the
    /// claim retried, leaving a job running under a token nobody held). Empty elsewhere.
    pub in_transaction: &'static str,
    /// Every text rendered for this backend, kept for the process's life.
    pub(crate) rendered: Rendered,
}

/// The statements [`Syntax::render`] made, by template text: each template is rendered once
/// per backend, then looked up (templates are the crate's constants and the few shapes
/// composed of them, so this holds a bounded set).
pub(crate) struct Rendered(OnceLock<RwLock<HashMap<Box<str>, &'static str>>>);

impl Rendered {
    pub(crate) const fn new() -> Rendered {
        Rendered(OnceLock::new())
    }
}

impl fmt::Debug for Rendered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendered").finish_non_exhaustive()
    }
}

/// `template` with `part` in place of `{name}`, for each `(name, part)`.
fn with_parts(template: &str, parts: &[(&str, &str)]) -> String {
    let mut text = template.to_string();
    for (name, part) in parts {
        text = text.replace(&format!("{{{name}}}"), part);
    }
    text
}

impl Syntax {
    /// Renders a statement template for this backend, once: later calls with the same text
    /// look it up. For the crate's templates (constants, and the few shapes composed of
    /// them); a text made per call (a bulk insert's rows) goes through [`Syntax::fill`].
    pub fn render(&self, template: &str) -> &'static str {
        let cache = self.rendered.0.get_or_init(RwLock::default);
        if let Some(sql) = cache
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(template)
        {
            return sql;
        }
        let sql: &'static str = Box::leak(self.fill(template).into_boxed_str());
        let mut cache = cache.write().unwrap_or_else(PoisonError::into_inner);
        cache.entry(template.into()).or_insert(sql)
    }

    /// [`Syntax::render`] of a template with the caller's own parts: `{name}` is `part` for
    /// each `(name, part)` (a mode's assignments, a list of states), then this backend's.
    pub fn render_with(&self, template: &str, parts: &[(&str, &str)]) -> &'static str {
        // Fragments that hold a part's placeholder (`{jobs}` in `{claim_mark_ids}`) first.
        let template = template.replace("{claim_mark_ids}", self.claim_mark_ids);
        self.render(&with_parts(&template, parts))
    }

    /// The `{jobs}` and `{slot_token}` parts of a statement about jobs of one slot: the
    /// slot's partition, named (a generic plan through the partitioned parent locks and
    /// sets up all seven partitions at each execution), and a claim token that names the
    /// slot in its last byte (`slot + 1`, `kept` 7), so that a finish finds it from the
    /// token alone. Without slots (or with no slot known), the table itself.
    pub fn slot_jobs(&self, slot: Option<i64>) -> [(&'static str, &'static str); 2] {
        const TABLES: [&str; 7] = [
            "tenure_jobs_kept AS tenure_jobs",
            "tenure_jobs_0 AS tenure_jobs",
            "tenure_jobs_1 AS tenure_jobs",
            "tenure_jobs_2 AS tenure_jobs",
            "tenure_jobs_3 AS tenure_jobs",
            "tenure_jobs_4 AS tenure_jobs",
            "tenure_jobs_5 AS tenure_jobs",
        ];
        const TOKENS: [&str; 7] = [
            "(left(gen_random_uuid()::text, 34) || '07')::uuid",
            "(left(gen_random_uuid()::text, 34) || '01')::uuid",
            "(left(gen_random_uuid()::text, 34) || '02')::uuid",
            "(left(gen_random_uuid()::text, 34) || '03')::uuid",
            "(left(gen_random_uuid()::text, 34) || '04')::uuid",
            "(left(gen_random_uuid()::text, 34) || '05')::uuid",
            "(left(gen_random_uuid()::text, 34) || '06')::uuid",
        ];
        match slot.and_then(|slot| usize::try_from(slot + 1).ok()) {
            Some(index) if self.job_slots && index < TABLES.len() => {
                [("jobs", TABLES[index]), ("slot_token", TOKENS[index])]
            }
            _ => [("jobs", "tenure_jobs"), ("slot_token", self.random_token)],
        }
    }

    /// The slot a claim token names (see [`Syntax::slot_jobs`]), if any.
    pub fn token_slot(&self, token: &uuid::Uuid) -> Option<i64> {
        if !self.job_slots {
            return None;
        }
        match token.as_bytes()[15] {
            code @ 1..=6 => Some(i64::from(code) - 1),
            7 => Some(-1),
            _ => None,
        }
    }

    /// [`Syntax::fill`] of a template with the caller's own parts (see
    /// [`Syntax::render_with`]).
    pub fn fill_with(&self, template: &str, parts: &[(&str, &str)]) -> String {
        self.fill(&with_parts(template, parts))
    }

    /// The template with this backend's fragments in place of its placeholders, made anew
    /// (for a text that is not kept: see [`Syntax::render`]). Fragments may hold
    /// placeholders of their own (`{window_over}` holds `{now}`): those come first.
    pub fn fill(&self, template: &str) -> String {
        template
            .replace("{window_over}", self.window_over)
            .replace("{greatest}", self.greatest)
            .replace("{now+ttl}", self.now_plus_micros)
            .replace("{now}", self.now)
            .replace("{grant_times}", self.grant_times)
            .replace("{for_update}", self.for_update)
            .replace("{skip_locked}", self.skip_locked)
            .replace("{random_token}", self.random_token)
            .replace("{claim_from}", self.claim_from)
            .replace("{claim_kind_from}", self.claim_kind_from)
            .replace("{fair_waiting_from}", self.fair_waiting_from)
            .replace("{fair_key_is}", self.fair_key_is)
            .replace("{claim_waiting}", self.claim_waiting)
            .replace("{claim_lock}", self.claim_lock)
            .replace("{claim_mark_ids}", self.claim_mark_ids)
            .replace("{in_transaction}", self.in_transaction)
            .replace("{keyed_jobs}", self.keyed_jobs)
            .replace("{pick_slot}", self.pick_slot)
            .replace("{slot_token}", self.random_token)
            .replace("{jobs}", "tenure_jobs")
    }
}

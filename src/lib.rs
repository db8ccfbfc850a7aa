//! # tenure: leases and a job queue in the database you already run
//!
//! tenure gives synchronous, thread-based Rust programs named, time-limited leases ("one at a
//! time" across threads, processes and hosts) and a job queue, on SQLite, PostgreSQL or
//! MySQL/MariaDB through diesel. No async runtime. The same API and the same guarantees on
//! every backend, each with the SQL that is right for it; SQLite is the default and needs no
//! server.
//!
//! This release holds the foundation (connections chosen from a URL, a pool with the right
//! per-connection settings, migrations, the database clock, transactions of the right kind,
//! an error type that says what a caller can do), [leases](lease) (named locks with fencing
//! tokens, and a [`LeaseGuard`] that renews them), the [job queue](jobs) with deduplication,
//! retention, flow control and workflows (dependencies, batches, results, progress), typed jobs ([`jobs::JobArgs`]), [workers](worker) that
//! run it on plain threads (short jobs claimed and recorded several at a time, each still fenced by
//! its own claim; only kinds they have handlers for), what workers report
//! ([events], `tracing`, and `tenure::metrics` with the `metrics` feature), helpers for
//! applications' tests ([testing]), and recurring [schedules]. The `cli` feature adds the `tenure` command (inspect and steer the tables,
//! pause and resume queues, run shell-command jobs, run a command under a lease, serve a web
//! dashboard with `tenure serve`, a demo). The repository's README.md is the tour; BENCHMARKS.md and
//! RELIABILITY.md hold the measured figures and the fault scenarios.
//!
//! ## Guarantees
//!
//! - **The database's clock decides.** Every instant that decides expiry or due-ness is read
//!   from the database, in UTC: `statement_timestamp()` on PostgreSQL (not `now()`, which is
//!   frozen at transaction start), `UTC_TIMESTAMP(6)` into `DATETIME(6)` on MySQL/MariaDB (not
//!   `TIMESTAMP`, which follows the session time zone and ends in 2038), and
//!   `strftime('%Y-%m-%d %H:%M:%f','now')` on SQLite. A session in another time zone sees the
//!   same instants. On SQLite "the database's clock" is the clock of the host that runs the
//!   statement, with millisecond resolution; processes sharing an SQLite file share a host.
//!   See [`database_now`].
//! - **Names are bytes.** Lease, queue and kind names compare byte for byte on every backend:
//!   `"Job"`, `"job"` and `"job "` are three names, also on MySQL, whose default collations
//!   would fold them together. Names are checked in Rust (non-empty, at most
//!   [`MAX_NAME_BYTES`] bytes, no NUL) before any statement, so nothing is ever truncated.
//! - **A lease has at most its N holders** (one unless [`lease::Take::holders`] asks for
//!   more). Each grant is decided in one transaction under the name's row lock: of any number
//!   of concurrent callers at most the free slots' number win, none gets an error; each grant
//!   has a fresh random token and a fence greater than every earlier one of its name,
//!   renewals and releases act only for the current token, and work can be committed only
//!   while the lease is held ([`lease::Lease::verify`]). Waiters are served first come, first
//!   served; releases wake them (the design: `docs/leases.md` in the repository).
//! - **A dead holder's lease is taken over within seconds** when a [`LeaseGuard`] from a pool
//!   held it ([`lease::Take::fast_takeover`]): its process holds a lock that ends with it.
//!   At once on SQLite, about 10 s after the death on the servers; a guard that can no longer
//!   tell that its lock is held counts its lease as lost before anyone else can be granted
//!   it, and a paused or slow holder keeps its lease until its ttl. In a Galera cluster, where
//!   such a lock is each node's own, the ttl alone ends a lease.
//! - **A job has one worker at a time.** A claim hands each job to one claimer, under a fresh
//!   token; completing, failing, renewing or giving it back is fenced by that token, so a
//!   worker whose claim lapsed and was rescued changes nothing. Handlers run at least once;
//!   completing inside the transaction of the handler's own writes makes those writes happen
//!   exactly once. A lapsed claim uses no attempt (a worker may die holding jobs it claimed
//!   ahead and never started) but counts as a lapse; [`jobs::MAX_LAPSES`] of them make a job
//!   dead, so a job that takes its worker down every time cannot loop forever.
//! - **On PostgreSQL and MariaDB, a claim walks no more than seconds of dead entries,
//!   whatever snapshot another transaction holds.** Claims read a ready ring
//!   (`tenure_ready`: one entry per waiting job, kept exact by triggers) whose oldest slot
//!   each rotation ([`jobs::rotate_ready`], every second in a worker; on MariaDB while purge
//!   lags) empties by `TRUNCATE`, which needs neither vacuum nor purge: a report or a
//!   forgotten `BEGIN` no longer slows every claim with the entries of every job claimed
//!   since it began (docs/storage-design.md). SQLite claims from `tenure_jobs`. On
//!   PostgreSQL `tenure_jobs` is also kept in six slots that new jobs fill in turn: once
//!   retention has deleted every job of a slot, [`jobs::rotate_job_slots`] (every second in a
//!   worker) truncates it, dead versions and all, without vacuum; a slot with any job still
//!   in it is never truncated (keyed jobs live apart, reclaimed by vacuum as before).
//! - **A dead worker is recognised by its process ending, not by a timer.** A worker holds a
//!   lock for its process's life (a database session's lock on a server, a file lock on
//!   SQLite): when it dies, its claims (running and claimed ahead) are taken back within
//!   seconds, not the claim ttl; a worker that is only stopped or slow keeps its lock and
//!   its jobs (see [`worker`], "When a worker dies").
//! - **A worker runs only kinds it has handlers for.** Its claim asks for those kinds in
//!   SQL: jobs of other kinds (a rolling deploy, a mixed fleet) wait for their own workers,
//!   never claimed, their attempts untouched.
//! - **A snooze uses no attempt, within a bound.** A handler's
//!   [`JobError::snooze`](worker::JobError::snooze) puts its job back without using an
//!   attempt, [`jobs::MAX_FREE_SNOOZES`] times at most; later snoozes use attempts, so a job
//!   cannot snooze forever unnoticed.
//! - **A run ends when its handler returns.** A worker records a run (and frees the job's
//!   concurrency-limit slot) only then: a run past its timeout or whose job was cancelled
//!   keeps its claim, renewed, while the handler runs, so no second run of the job starts
//!   meanwhile and at most n handlers of a `limit(key, n)` run at once.
//! - **The jobs of a sequence run one at a time, in enqueue order.** A job enqueued with
//!   [`jobs::NewJob::sequence`] is blocked until the job enqueued before it with that key
//!   (enqueues of a key are ordered by a row lock) has completed, and is released by the
//!   transaction that completes it: a retrying, snoozed or delayed job holds the rest back. A
//!   dead or cancelled one holds them too ([`jobs::SequenceFailure::Hold`]) until it is retried
//!   and completes or [`jobs::skip_in_sequence`] lets them go on, unless the enqueuer chose
//!   [`jobs::SequenceFailure::Continue`]. A job cancelled before it ran is taken out of its
//!   sequence: the next waits for the one before it.
//! - **Priorities starve no job whose queue ages them.** Claims take the most urgent
//!   priority first; [`jobs::age_priorities`] (every quarter of the bound in a worker built
//!   with [`worker::WorkerBuilder::age_priorities`]) moves a job due for longer than its bound
//!   to [`jobs::AGED_PRIORITY`], where only jobs that came due before it are claimed first: a
//!   stream of more urgent jobs delays it by at most the bound plus one pass.
//! - **Tenants take turns in a fair queue.** A job enqueued with [`jobs::NewJob::fair_key`]
//!   gets its tenant's next turn in its queue's virtual time (the tenant's row lock orders
//!   its enqueues, so no two of its waiting jobs share a turn), and claims take turns in
//!   order within a priority, by weight ([`jobs::set_fair_weight`]): a tenant arriving
//!   behind another's backlog waits for about one job per waiting tenant, not for the
//!   backlog, and a lone tenant gets all the capacity. A claim's cost does not grow with
//!   the number of tenants (the turn is in the claim index).
//! - **A dependent job runs once, when its dependencies allow.** A job that depends on
//!   others ([`jobs::NewJob::depends_on`], [`jobs::Workflow`]) is `blocked` until they
//!   finish as its [`jobs::RunWhen`] asks, and is released (or cancelled) by the transaction
//!   that finishes the last of them, decided by row-locked counters: dependencies finishing
//!   at the same instant release it exactly once, never zero times. A batch's callbacks fire
//!   once. Results ([`jobs::JobResult`]) commit with their completion, and retention keeps a
//!   job while a job that depends on it has not finished.
//! - **Waiting for a job's end gets its true outcome once, holding no connection asleep.**
//!   [`jobs::wait`] returns when the job is completed (with its result), dead or cancelled,
//!   or [`Error::WaitTimedOut`] at its timeout; a lapsed claim is not an end. The waiters of
//!   a process on one database share one read, at most every [`jobs::POLL_INTERVAL`].
//! - **A parked job is answered once by its token.** A job parked by its run
//!   ([`worker::JobContext::park`]) or at enqueue ([`jobs::enqueue_parked`]) holds no claim
//!   and no slot until its [`jobs::ParkToken`] completes, fails or resumes it
//!   ([`jobs::complete_parked`]) or its deadline passes (database clock): every transition
//!   locks the job's row first, so of two answers, or an answer and the deadline, exactly one
//!   applies; any other use of a token is [`Error::ParkTokenRefused`] and changes nothing.
//!   Tokens are stored as SHA-256 hashes and compared in constant time. Once `ctx.park`
//!   returned a token the job waits for it, through a shutdown, a timeout, or its worker's
//!   death (the rescue parks it), unless the handler itself ends the run another way.
//! - **A step runs once per job, its result committed with its writes.**
//!   [`JobContext::step`](worker::JobContext::step) stores a step's result in the
//!   transaction of the step's own writes, after checking, under the job row's lock, that the
//!   run still holds its claim: a retry gets the stored result and the step does not run
//!   again, and what a step writes to the same database lands exactly once per job, also when
//!   its worker is killed mid-step. The run that stores a step gets the value a retry reads
//!   back (a value JSON cannot carry, a NaN, is refused, not stored). A run that lost its
//!   claim, or whose job was asked to cancel, commits nothing and gets [`Error::ClaimLost`]
//!   from every step, stored or not.
//! - **Bad input changes nothing.** It is an [`Error::InvalidInput`] before any statement.
//!   Instants given to tenure (a job's due time, a retry time) must lie in the years 1 to 9999,
//!   what every backend stores and orders correctly (MySQL's `DATETIME` ends in 9999, SQLite
//!   compares four-digit years as text); due times tenure computes are the database's now plus
//!   at most 366 days.
//! - **Errors are never "nothing there".** A database error is returned as an error, and
//!   [`Error::is_retryable`] / [`Error::is_outcome_unknown`] say whether to repeat the call or
//!   to check first.
//! - **What was acknowledged survives a failover that can keep it, and tenure says when one
//!   cannot.** Through a PostgreSQL failover to a synchronous standby (Patroni, measured) and
//!   a Galera node's death, nothing acknowledged is lost and fences keep growing; a [`Pool`]
//!   connects again within about a second of the server's return. Asynchronous standbys can
//!   lose the last commits a crashed primary acknowledged: [`replication`] reports them and
//!   [`Pool::open`] warns (SCALING.md, section 0).
//!
//! ## Connections
//!
//! Every operation takes `&mut C` where `C: `[`TenureConnection`]: diesel's `SqliteConnection`,
//! `PgConnection`, `MysqlConnection`, tenure's [`AnyConnection`] (backend chosen at run time by
//! [`AnyConnection::connect`]) or a connection from an r2d2 pool of any of them. [`Pool`]
//! opens a pool from a URL with [`SessionSetup`] applied to each connection (SQLite: WAL, a busy
//! timeout, `synchronous=FULL`; MySQL: UTC, strict mode); [`AnyConnection::connect`] applies
//! the same defaults, [`AnyConnection::connect_raw`] none. A connection you open yourself
//! (diesel's `establish`) has none until you call [`SessionSetup::apply`]: on SQLite, without a
//! busy timeout, any write that meets another connection's write lock fails at once.
//!
//! ## Your own queries on tenure's tables
//!
//! [`schema`] has a diesel `table!` for every tenure table, and the models that read them are
//! public ([`jobs::Job`], [`jobs::FailedRun`], [`jobs::RunOutput`], [`lease::LeaseRecord`],
//! [`schedules::ScheduleRecord`]): join your tables to tenure's jobs with diesel's query
//! builder, on any backend and on [`AnyConnection`] ([`AnyBackend`] knows tenure's portable
//! [`sql_types`]). A conformance test checks the schema against the migrations on every
//! backend. Read them freely; change them only through tenure's functions.
//!
//! tenure's own statements are prepared once per connection and then only executed: the query
//! builder where it says what tenure means, and its tuned per-backend SQL as cacheable
//! statements with bound values (no value is ever formatted into SQL text; id lists are
//! bound in a few fixed lengths). A multi-row insert, whose text changes with its row
//! count, is the one statement prepared each time.
//!
//! ## Caller's transactions
//!
//! Some operations join the caller's open transaction, so their writes commit or roll back
//! with the caller's own: [`jobs::enqueue`] and [`jobs::enqueue_many`]; [`jobs::complete`]
//! (with the handler's own writes: the exactly-once way to finish a job), [`jobs::fail`],
//! [`jobs::renew`] and [`jobs::give_back`]; [`lease::Lease::verify`] (work commits only while
//! the lease is held) and [`LeaseGuard::release_on`]; and the operator calls
//! [`jobs::cancel`], [`jobs::retry_dead`], [`jobs::pause`] and [`jobs::resume`]. On a bare
//! connection they commit on their own. Use
//! [`transaction()`] to open the right kind of transaction for them (IMMEDIATE on SQLite).
//!
//! Others need a bare connection and open the transaction they need themselves: taking,
//! renewing and releasing a lease, [`jobs::claim`], [`jobs::rescue`], [`jobs::prune`], and
//! [`run_migrations`]. Inside a caller's transaction they return [`Error::InTransaction`] and
//! send nothing, because:
//!
//! - MySQL/MariaDB cannot change the isolation level inside an open transaction, and these
//!   operations need READ COMMITTED (under REPEATABLE READ, `FOR UPDATE SKIP LOCKED` also
//!   locks the gaps between index entries, and concurrent claimers deadlock);
//! - SQLite needs `BEGIN IMMEDIATE`, so that the write lock is held from the start and the
//!   read that decides cannot be overtaken by another writer;
//! - a lease or a claim must be visible to others the moment it is granted, not when the
//!   caller's unrelated transaction commits (and must not vanish if it rolls back);
//! - MySQL commits DDL implicitly, which would commit the caller's transaction half-way.
//!
//! ## Tested on
//!
//! MariaDB 10.11, PostgreSQL 15 and the bundled SQLite (3.5x). Other versions (MySQL 8,
//! newer PostgreSQL) are expected to work but are best-effort until tested.
#![deny(missing_docs)]

mod backend;
mod error;
pub mod events;
pub mod jobs;
pub mod lease;
#[cfg(feature = "metrics")]
pub mod metrics;
mod migrate;
mod pool;
mod redact;
mod rows;
pub mod schedules;
pub mod schema;
pub mod sql_types;
pub mod testing;
mod validate;
mod wake;
pub mod worker;

/// The diesel tenure is built with, for your own queries beside tenure's (`use
/// tenure::diesel::prelude::*`): its version and features always match tenure's.
pub use diesel;

pub use backend::{
    AnyConnection, Backend, BackendConnection, Replication, SessionSetup, Synchronous,
    TenureConnection,
};
/// The diesel backend of [`AnyConnection`] (the one its queries are built for): tenure's SQL
/// types ([`sql_types::Instant`], [`sql_types::Token`]) and [`schema`] work with it.
pub type AnyBackend = <AnyConnection as diesel::Connection>::Backend;
pub use backend::transaction::transaction;
pub use error::{Error, Result};
pub use lease::LeaseGuard;
pub use migrate::{VERSION_PREFIX, run_migrations, schema_version};
pub use pool::{ConnectionManager, Pool, PoolOptions, PooledConnection};
pub use validate::{MAX_LABEL_BYTES, MAX_NAME_BYTES, MAX_TTL};

use backend::{Dialect, dispatch};

/// The database's clock, in UTC: the instant every expiry and due time is measured against.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// let now = tenure::database_now(&mut conn)?;
/// assert!((chrono::Utc::now() - now).num_seconds().abs() < 5);
/// # Ok(()) }
/// ```
pub fn database_now<C: TenureConnection>(conn: &mut C) -> Result<chrono::DateTime<chrono::Utc>> {
    Ok(dispatch!(conn, c => c.database_now())?)
}

/// How the database behind `conn` replicates its commits: whether a failover can lose what
/// tenure acknowledged ([`Replication`] says what each answer means). [`Pool`] logs a warning
/// when it opens on an asynchronously replicated primary.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// assert_eq!(tenure::replication(&mut conn)?, tenure::Replication::Standalone);
/// # Ok(()) }
/// ```
pub fn replication<C: TenureConnection>(conn: &mut C) -> Result<Replication> {
    dispatch!(conn, c => c.replication())
}

/// The README's Rust examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The guide's Rust examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
struct GuideDoctests;

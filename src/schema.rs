//! tenure's tables, as diesel `table!` definitions: the contract of what tenure stores, for
//! querying and joining tenure's tables from your own diesel code.
//!
//! Column types are the ones that mean the same on every backend: names are `Text` (stored
//! byte-exact: `COLLATE "C"` on PostgreSQL, `VARBINARY` on MySQL/MariaDB, SQLite's binary
//! collation), instants are [`Instant`](crate::sql_types::Instant) (`chrono::DateTime<Utc>`),
//! tokens [`Token`](crate::sql_types::Token) (`uuid::Uuid`); bind your own values against them
//! as [`InstantValue`](crate::sql_types::InstantValue) and
//! [`TokenValue`](crate::sql_types::TokenValue). They work on `SqliteConnection`,
//! `PgConnection`, `MysqlConnection`, [`AnyConnection`](crate::AnyConnection) and pooled
//! connections of each. A conformance test checks these definitions against the migrated
//! database on every backend. The models that select them are [`Job`](crate::jobs::Job),
//! [`FailedRun`](crate::jobs::FailedRun), [`RunOutput`](crate::jobs::RunOutput),
//! [`LeaseRecord`](crate::lease::LeaseRecord) and [`ScheduleRecord`](crate::schedules::ScheduleRecord).
//!
//! Read them freely; write them only through tenure's functions, which keep the invariants
//! (claim tokens, fences, limits) that a plain UPDATE would not.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use diesel::prelude::*;
//! use tenure::jobs::{Job, JobState, NewJob};
//! use tenure::schema::tenure_jobs;
//!
//! let mut conn = tenure::AnyConnection::connect(":memory:")?;
//! tenure::run_migrations(&mut conn)?;
//! tenure::jobs::enqueue(&mut conn, &NewJob::new("mail", "welcome", vec![]))?;
//!
//! let waiting: Vec<Job> = tenure_jobs::table
//!     .filter(tenure_jobs::queue.eq("mail"))
//!     .filter(tenure_jobs::state.eq(JobState::Waiting))
//!     .select(Job::as_select())
//!     .load(&mut conn)?;
//! assert_eq!(waiting.len(), 1);
//! # Ok(()) }
//! ```

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::{Instant, Token};

    /// Leases: one row per holder slot of a name (`slot` 0 .. N-1; a lease of one holder has
    /// only slot 0). Never deleted by tenure.
    tenure_leases (name, slot) {
        /// The lease's name.
        name -> Text,
        /// Which of the name's holders this row is (0 .. N-1).
        slot -> Integer,
        /// The current grant's token; NULL once released.
        token -> Nullable<Token>,
        /// The last holder's label.
        holder -> Text,
        /// The last grant's fence (fences grow per name, over all its slots).
        fence -> BigInt,
        /// When the last grant was made.
        acquired_at -> Instant,
        /// When it expires (or expired, or was released).
        expires_at -> Instant,
        /// When the slot may be granted again: the release time after a release; the expiry
        /// plus the holder's lock delay while held or lapsed; after a force release, its time
        /// plus that delay.
        reusable_at -> Instant,
        /// The lock delay the holder asked for, in microseconds (0: none).
        lock_delay_us -> BigInt,
        /// What the holder published with its grant ([`Lease::set_value`](crate::lease::Lease::set_value)); cleared at each grant.
        value -> Nullable<Text>,
        /// The key of the holder's liveness lock (fast takeover, see
        /// [`Take::fast_takeover`](crate::lease::Take::fast_takeover)); NULL when it has
        /// none.
        held_by -> Nullable<BigInt>,
    }
}

diesel::table! {
    use diesel::sql_types::*;

    /// One row per lease name, never deleted (so fences never go back). Every grant of the
    /// name locks it.
    tenure_lease_names (name) {
        /// The lease's name.
        name -> Text,
        /// How many may hold it at once (N), as its current or last holders asked.
        holders -> Integer,
        /// The last fence granted for the name, whichever slot.
        fence -> BigInt,
        /// The ticket the next waiter gets.
        next_ticket -> BigInt,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// Callers waiting in line for a lease, served in ticket order.
    tenure_lease_waiters (name, ticket) {
        /// The lease's name.
        name -> Text,
        /// The waiter's place in line (smaller: earlier).
        ticket -> BigInt,
        /// The waiter's holder label.
        holder -> Text,
        /// When it joined the line.
        joined_at -> Instant,
        /// When its place lapses unless it renews it (it gave up or died).
        expires_at -> Instant,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::{Instant, Token};

    /// Jobs.
    tenure_jobs (id) {
        /// The job's id.
        id -> BigInt,
        /// Its queue.
        queue -> Text,
        /// Its kind.
        kind -> Text,
        /// Its payload.
        payload -> Binary,
        /// Lower runs first.
        priority -> Integer,
        /// `blocked`, `waiting`, `running`, `parked`, `completed`, `dead` or `cancelled`
        /// ([`JobState`](crate::jobs::JobState)).
        state -> Text,
        /// Runs started (a lapsed claim's run is given back).
        attempt -> Integer,
        /// Runs allowed.
        max_attempts -> Integer,
        /// When it is (or was) due.
        due_at -> Instant,
        /// When it was enqueued.
        created_at -> Instant,
        /// The current claim's token, while running.
        claim_token -> Nullable<Token>,
        /// When the current (or last) claim was made.
        claimed_at -> Nullable<Instant>,
        /// When the current claim lapses unless renewed.
        claim_expires_at -> Nullable<Instant>,
        /// When it completed, died or was cancelled.
        finished_at -> Nullable<Instant>,
        /// The last failed run's error.
        last_error -> Nullable<Text>,
        /// Its dedup key: unique per queue among live (waiting or running) jobs.
        dedup_key -> Nullable<Text>,
        /// Enqueues folded into it by its dedup key.
        dedup_hits -> BigInt,
        /// Its concurrency-limit key.
        limit_key -> Nullable<Text>,
        /// The most jobs of its limit key that run at once.
        limit_max -> Nullable<Integer>,
        /// Lapses charged to it (the first, then those of runs that began); dead at
        /// [`MAX_LAPSES`](crate::jobs::MAX_LAPSES).
        lapses -> Integer,
        /// When a cancel was asked for while it ran.
        cancel_requested_at -> Nullable<Instant>,
        /// How often its runs were snoozed ([`snooze`](crate::jobs::snooze)).
        snoozes -> Integer,
        /// How long after it finishes it still folds enqueues of its dedup key, in
        /// microseconds ([`NewJob::dedup_window`](crate::jobs::NewJob::dedup_window)); NULL:
        /// only while live. Retention keeps it until `finished_at` plus this.
        dedup_window_micros -> Nullable<BigInt>,
        /// The workflow (`tenure_workflows`) it belongs to, if any.
        workflow_id -> Nullable<BigInt>,
        /// With dependencies: when it runs, `all_completed`, `all_finished` or `any_failed`
        /// ([`RunWhen`](crate::jobs::RunWhen)); it is `blocked` until then.
        run_when -> Nullable<Text>,
        /// Its dependency stripes (`tenure_dependency_stripes`) with dependencies pending.
        stripes_pending -> Nullable<Integer>,
        /// How many jobs were enqueued depending on it.
        dependents -> Integer,
        /// What it last reported of its progress while running.
        progress -> Nullable<Double>,
        /// The message with that progress.
        progress_message -> Nullable<Text>,
        /// The worker ([`tenure_workers`](crate::schema::tenure_workers)) whose claim it runs (or
        /// last ran) under; NULL for a claim made outside a worker
        /// ([`claim`](crate::jobs::claim)).
        claimed_by -> Nullable<BigInt>,
        /// When the current claim's run began, where that is recorded: at the claim for a
        /// claim made outside a worker, by the worker for a job whose claims lapsed before.
        /// A lapse counts against a job the first time, then only for a run that began.
        started_at -> Nullable<Instant>,
        /// Its sequence key ([`NewJob::sequence`](crate::jobs::NewJob::sequence)): it runs
        /// after the job enqueued before it with this key has completed.
        sequence_key -> Nullable<Text>,
    }
}

diesel::table! {
    /// Fair claiming: per queue and tenant, its weight; the row's lock orders the tenant's
    /// enqueues ([`crate::jobs::NewJob::fair_key`], [`crate::jobs::set_fair_weight`]). A
    /// job's tenant and turn are `tenure_jobs.fair_key` and `fair_stamp`, which this schema
    /// leaves out (diesel's 32 columns): claims order by priority, then `fair_stamp` (0 for
    /// a job without a fair key), then due time.
    tenure_fair_keys (queue, fair_key) {
        /// The queue.
        queue -> Text,
        /// The tenant.
        fair_key -> Text,
        /// Its weight (1 to 1,000): its share of the queue against weight-1 tenants.
        weight -> Integer,
    }
}

diesel::table! {
    /// Sequences: per key, the last job enqueued with it; the row's lock orders the enqueues
    /// of a key ([`NewJob::sequence`](crate::jobs::NewJob::sequence)).
    tenure_sequences (sequence_key) {
        /// The key.
        sequence_key -> Text,
        /// The last job enqueued with it (it may have been pruned since).
        last_job_id -> BigInt,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// The errors of jobs' failed runs (the newest 20 per job).
    tenure_job_errors (id) {
        /// The entry's id.
        id -> BigInt,
        /// The job's id.
        job_id -> BigInt,
        /// Which run failed.
        attempt -> Integer,
        /// Its error.
        error -> Text,
        /// When.
        failed_at -> Instant,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// What runs printed and how they exited (jobs whose runs report it).
    tenure_job_outputs (id) {
        /// The entry's id.
        id -> BigInt,
        /// The job's id.
        job_id -> BigInt,
        /// Which run.
        attempt -> Integer,
        /// Its exit code, if it exited with one.
        exit_code -> Nullable<Integer>,
        /// What it printed (the tail).
        output -> Binary,
        /// When it was recorded.
        finished_at -> Instant,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// Paused queues: claims skip them.
    tenure_queue_pauses (queue) {
        /// The queue.
        queue -> Text,
        /// Since when.
        paused_at -> Instant,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// Recurring schedules.
    tenure_schedules (name) {
        /// Its name.
        name -> Text,
        /// Its cron expression (or NULL with an interval).
        cron -> Nullable<Text>,
        /// Its interval in microseconds (or NULL with a cron expression).
        interval_micros -> Nullable<BigInt>,
        /// The time zone of its cron expression.
        time_zone -> Text,
        /// Its jobs' queue.
        queue -> Text,
        /// Their kind.
        kind -> Text,
        /// Their payload.
        payload -> Binary,
        /// Their priority.
        priority -> Integer,
        /// Their attempts.
        max_attempts -> Integer,
        /// 1: fire every missed tick after downtime.
        catch_up -> Integer,
        /// 1: paused.
        paused -> Integer,
        /// Its next tick.
        next_due_at -> Instant,
        /// Its jobs' dedup key.
        dedup_key -> Nullable<Text>,
        /// Its jobs' concurrency-limit key.
        limit_key -> Nullable<Text>,
        /// Its jobs' concurrency limit.
        limit_max -> Nullable<Integer>,
        /// How long after each tick its job is due, in microseconds.
        delay_micros -> BigInt,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// Limit keys: claimers of a key serialize on its row.
    tenure_limit_keys (limit_key) {
        /// The key.
        limit_key -> Text,
        /// Until then the key's rate of `throttled_max` starts per `throttled_period_us` is
        /// full (a hint for the claim's pick).
        throttled_until -> Nullable<Instant>,
        /// The count of that rate.
        throttled_max -> Nullable<Integer>,
        /// The period of that rate, in microseconds.
        throttled_period_us -> Nullable<BigInt>,
        /// Its rows in `tenure_limit_starts` (the newest 10,000 are kept, at least).
        starts_kept -> BigInt,
    }
}

diesel::table! {
    /// A job's limits, one row per key ([`crate::jobs::Limit`]).
    tenure_job_limits (job_id, limit_key) {
        /// The job.
        job_id -> BigInt,
        /// The key.
        limit_key -> Text,
        /// At most so many running jobs with this key.
        max_running -> Nullable<Integer>,
        /// At most so many starts of this key per `rate_period_us`.
        rate_max -> Nullable<Integer>,
        /// The rate's period, in microseconds.
        rate_period_us -> Nullable<BigInt>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// The starts of rate-limited keys: the newest 10,000 per key, at least.
    tenure_limit_starts (limit_key, started_at, job_id) {
        /// The key.
        limit_key -> Text,
        /// When a job with the key was claimed (its `claimed_at`).
        started_at -> Instant,
        /// That job.
        job_id -> BigInt,
    }
}

diesel::table! {
    /// Queue-wide concurrency limits ([`crate::jobs::limit_queue`]).
    tenure_queue_limits (queue) {
        /// The queue.
        queue -> Text,
        /// At most so many running jobs of the queue.
        max_running -> Integer,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// Workflows and batches ([`crate::jobs::Workflow`]): jobs with `workflow_id` are theirs.
    tenure_workflows (id) {
        /// The workflow's id.
        id -> BigInt,
        /// Its name.
        name -> Text,
        /// When it was enqueued.
        created_at -> Instant,
        /// The job that runs when every other job of it completed.
        on_success -> Nullable<BigInt>,
        /// The job that runs when the first of them dies or is cancelled.
        on_failure -> Nullable<BigInt>,
        /// The job that runs when all of them finished, however.
        on_finish -> Nullable<BigInt>,
    }
}

diesel::table! {
    /// Dependencies: `job_id` waits for `depends_on`.
    tenure_job_dependencies (job_id, depends_on) {
        /// The job that waits.
        job_id -> BigInt,
        /// The job it waits for.
        depends_on -> BigInt,
        /// The stripe of `job_id` this dependency counts in.
        stripe -> Integer,
        /// 1 once `depends_on` finished and its stripe was counted down.
        counted -> Integer,
        /// `job_id`'s [`RunWhen`](crate::jobs::RunWhen) (it never changes), or
        /// `sequence_hold`: the edge of a sequence whose dead or cancelled predecessor holds
        /// `job_id` until it completes after all or an operator lets the sequence go on
        /// ([`skip_in_sequence`](crate::jobs::skip_in_sequence)).
        run_when -> Text,
    }
}

diesel::table! {
    /// A blocked job's pending dependencies, counted in stripes so that finishing them at
    /// once does not serialize on one row.
    tenure_dependency_stripes (job_id, stripe) {
        /// The blocked job.
        job_id -> BigInt,
        /// The stripe.
        stripe -> Integer,
        /// Its dependencies not yet finished.
        pending -> Integer,
    }
}

diesel::table! {
    /// Results of completed jobs ([`crate::jobs::JobResult`]).
    tenure_job_results (job_id) {
        /// The job.
        job_id -> BigInt,
        /// `json` or `bytes`.
        format -> Text,
        /// The result.
        body -> Binary,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::{Instant, Token};

    /// Parked jobs ([`crate::jobs::ParkToken`]): one row per job, its last park, deleted with
    /// the job. Written only while holding the job's row lock.
    tenure_parked (job_id) {
        /// The job.
        job_id -> BigInt,
        /// SHA-256 of the token's secret (the secret is never stored).
        token_hash -> Binary,
        /// The run that parked it; NULL when parked at enqueue.
        claim_token -> Nullable<Token>,
        /// When the park was recorded.
        parked_at -> Instant,
        /// When it fails (or retries) unless answered (database clock).
        deadline -> Instant,
        /// The backoff of a failure's retry: its base, in microseconds.
        backoff_base_micros -> BigInt,
        /// The backoff of a failure's retry: its longest delay, in microseconds.
        backoff_max_micros -> BigInt,
        /// `complete`, `fail` or `resume` once the token was used (`pending-...` while the run
        /// that parked held its claim), `expired` or `dropped` once closed; NULL while open.
        answer -> Nullable<Text>,
        /// The answer's value (`json` or `bytes`): a completion's result, a resume's value.
        value_format -> Nullable<Text>,
        /// That value.
        value_body -> Nullable<Binary>,
        /// A failure's error.
        answer_error -> Nullable<Text>,
        /// When the token was used.
        answered_at -> Nullable<Instant>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// A job's completed steps ([`crate::worker::JobContext::step`], [`crate::jobs::steps`]):
    /// kept across its retries, deleted with it.
    tenure_steps (job_id, name) {
        /// The job.
        job_id -> BigInt,
        /// The step's name.
        name -> Text,
        /// Its result, as JSON.
        result -> Binary,
        /// When it committed (database clock).
        created_at -> Instant,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::sql_types::Instant;

    /// Running workers: how a dead worker is recognised (see
    /// [`crate::worker`], "When a worker dies"). A worker inserts its row and takes a lock
    /// that lasts as long as its process: on PostgreSQL the session-level advisory lock
    /// `pg_advisory_lock(1952804469, id)` (the id's low 32 bits), on MySQL/MariaDB the named
    /// lock `CONCAT('tenure.w.', MD5(DATABASE()), '.', id)`, each on a connection the
    /// worker keeps; on SQLite an exclusive `flock` of the file `<database>-workers/<id>`.
    tenure_workers (id) {
        /// The worker's id (never reused).
        id -> BigInt,
        /// The host it runs on.
        host -> Text,
        /// Its process id on that host.
        pid -> BigInt,
        /// When it registered.
        started_at -> Instant,
        /// When it last said it lives (every second).
        heartbeat_at -> Instant,
        /// When a rescue first found its lock free (NULL while it is held).
        lock_free_since -> Nullable<Instant>,
    }
}

diesel::joinable!(tenure_job_errors -> tenure_jobs (job_id));
diesel::joinable!(tenure_job_outputs -> tenure_jobs (job_id));
diesel::joinable!(tenure_job_limits -> tenure_jobs (job_id));
diesel::joinable!(tenure_job_results -> tenure_jobs (job_id));
diesel::joinable!(tenure_parked -> tenure_jobs (job_id));
diesel::joinable!(tenure_steps -> tenure_jobs (job_id));
diesel::joinable!(tenure_dependency_stripes -> tenure_jobs (job_id));

diesel::allow_tables_to_appear_in_same_query!(
    tenure_leases,
    tenure_lease_names,
    tenure_lease_waiters,
    tenure_jobs,
    tenure_job_errors,
    tenure_job_outputs,
    tenure_queue_pauses,
    tenure_schedules,
    tenure_limit_keys,
    tenure_job_limits,
    tenure_limit_starts,
    tenure_queue_limits,
    tenure_workflows,
    tenure_job_dependencies,
    tenure_dependency_stripes,
    tenure_sequences,
    tenure_fair_keys,
    tenure_job_results,
    tenure_parked,
    tenure_steps,
    tenure_workers,
);

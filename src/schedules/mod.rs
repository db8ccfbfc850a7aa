//! Recurring schedules: a job enqueued once per tick of a cron expression or a fixed
//! interval, by any number of schedulers in any number of processes.
//!
//! Firing a tick is a compare-and-set on the schedule's `next_due_at`, in the same
//! transaction as the enqueue: of any number of schedulers only one moves a schedule past a
//! tick, and its job commits with that move or not at all. (A unique index on jobs could not
//! do this: retention deletes those rows.) Due-ness is decided by the database's clock.
//!
//! - Cron: standard 5 fields, or 6 with seconds first, parsed by `croner`, evaluated in the
//!   schedule's time zone (IANA name, UTC by default). Across DST changes: a fixed-time tick
//!   that falls in the spring-forward gap fires at the first instant after the gap; one in
//!   the fall-back overlap fires once, at its first occurrence.
//! - Interval: every `n` from the moment the schedule was created or last changed, in
//!   absolute time (no DST effect).
//! - After downtime a schedule fires once for all the ticks it missed (the newest), unless it
//!   catches up, firing each missed tick (at most [`MAX_TICKS_PER_CALL`] per call and
//!   schedule). Without catch-up the next tick is computed from now, so a long downtime costs
//!   no more than a short one.
//! - Each tick's job is the schedule's job, due at the tick plus the job's delay, with its
//!   priority, attempts, dedup key and concurrency limit.
//! - Declaring a schedule again (as a program does at every start) keeps its next tick when
//!   its timing (cron expression or interval, and time zone) is unchanged, so a tick missed
//!   while the program was down still fires.
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! use std::time::Duration;
//! use tenure::jobs::NewJob;
//! use tenure::schedules::{self, Schedule};
//! let mut conn = tenure::AnyConnection::connect(":memory:")?;
//! tenure::run_migrations(&mut conn)?;
//! schedules::upsert(&mut conn, &Schedule::cron("nightly-report", "0 3 * * *", NewJob::new("reports", "nightly", vec![]))
//!     .time_zone("Europe/Lisbon"))?;
//! schedules::upsert(&mut conn, &Schedule::every("heartbeat", Duration::from_secs(60), NewJob::new("ops", "ping", vec![])))?;
//! let fired = schedules::tick(&mut conn)?; // run this from every scheduler, often
//! assert_eq!(fired, 0); // nothing due yet
//! # Ok(()) }
//! ```

mod timing;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};

use crate::backend::statement::statement;
use crate::backend::transaction::{bare_write_transaction, write_turn};
use crate::backend::{Dialect, Upsert, dispatch};
use crate::jobs::{self, Due, NewJob};
use crate::sql_types::Instant;
use crate::{Error, Result, TenureConnection, validate};
use timing::Timing;

/// When a schedule ticks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spec {
    /// A cron expression: 5 fields, or 6 with seconds first.
    Cron(String),
    /// A fixed interval (1 ms to 366 days).
    Every(Duration),
}

/// A recurring schedule: when it ticks, and the job it enqueues at each tick: due at the
/// tick's instant plus the job's [`delay`](NewJob::delay), with its priority, attempts,
/// [dedup key](NewJob::dedup_key) and [limit](NewJob::limit). A job due at a fixed instant
/// ([`NewJob::at`]) cannot recur: [`upsert`] refuses it, and a job with a
/// [dedup window](NewJob::dedup_window) or an [`OnDuplicate`](crate::jobs::OnDuplicate) mode
/// other than `Keep` too (a schedule stores neither).
#[derive(Debug, Clone)]
pub struct Schedule {
    name: String,
    spec: Spec,
    time_zone: String,
    job: NewJob,
    catch_up: bool,
}

impl Schedule {
    /// Ticks on a cron expression (in UTC unless [`Schedule::time_zone`] says otherwise).
    pub fn cron(name: impl Into<String>, expression: impl Into<String>, job: NewJob) -> Self {
        Schedule::new(name.into(), Spec::Cron(expression.into()), job)
    }

    /// Ticks every `interval`.
    pub fn every(name: impl Into<String>, interval: Duration, job: NewJob) -> Self {
        Schedule::new(name.into(), Spec::Every(interval), job)
    }

    fn new(name: String, spec: Spec, job: NewJob) -> Self {
        Schedule {
            name,
            spec,
            time_zone: "UTC".to_string(),
            job,
            catch_up: false,
        }
    }

    /// The IANA time zone the cron expression is read in (default `UTC`).
    pub fn time_zone(mut self, zone: impl Into<String>) -> Self {
        self.time_zone = zone.into();
        self
    }

    /// After downtime, fire every missed tick (default: fire once for all of them).
    pub fn catch_up(mut self, every_missed_tick: bool) -> Self {
        self.catch_up = every_missed_tick;
        self
    }

    /// The timing, and the job's delay in microseconds.
    fn validate(&self) -> Result<(Timing, i64)> {
        validate::name("schedule name", &self.name)?;
        self.job.validate()?;
        // A schedule stores one concurrency limit (tenure_schedules.limit_key, limit_max).
        let one_concurrency_limit = match self.job.limits() {
            [] => true,
            [limit] => limit.rate_cap().is_none(),
            _ => false,
        };
        if !one_concurrency_limit {
            return Err(Error::invalid(
                "schedule job",
                "a schedule's job carries at most one limit, a concurrency limit",
            ));
        }
        // A schedule stores no sequence (its ticks are one key's jobs already, one per tick):
        // refused, never dropped.
        if self.job.sequence.is_some() {
            return Err(Error::invalid(
                "schedule job",
                "a schedule's job cannot have a sequence key (a schedule does not keep one)",
            ));
        }
        // A schedule stores no dedup window and no OnDuplicate mode: refused, never dropped.
        if self.job.dedup_window.is_some() {
            return Err(Error::invalid(
                "schedule job",
                "a schedule's job cannot have a dedup window (a schedule does not keep one)",
            ));
        }
        if self.job.on_duplicate != crate::jobs::OnDuplicate::Keep {
            return Err(Error::invalid(
                "schedule job",
                "a schedule's job keeps a live job of its key (OnDuplicate::Keep); other modes are not kept",
            ));
        }
        let delay = match self.job.due {
            Due::After(_) => self.job.due_params().1,
            Due::At(at) => {
                return Err(Error::invalid(
                    "schedule job",
                    format!(
                        "is due at {at}; a schedule's job is due at each tick (plus a delay), \
                         not at a fixed instant"
                    ),
                ));
            }
        };
        Ok((Timing::new(&self.spec, &self.time_zone)?, delay))
    }
}

/// The most ticks one [`tick`] call fires for one catching-up schedule (the next call goes on).
pub const MAX_TICKS_PER_CALL: usize = 1000;

/// A schedule as stored, from [`list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleInfo {
    /// Its name.
    pub name: String,
    /// When it ticks.
    pub spec: Spec,
    /// The time zone of its cron expression.
    pub time_zone: String,
    /// The queue its jobs go to.
    pub queue: String,
    /// Their kind.
    pub kind: String,
    /// Their dedup key, if any.
    pub dedup_key: Option<String>,
    /// Their concurrency limit (key and most running at once), if any.
    pub limit: Option<(String, u32)>,
    /// How long after its tick each job is due.
    pub delay: Duration,
    /// Whether it fires every missed tick after downtime.
    pub catch_up: bool,
    /// Whether it is paused.
    pub paused: bool,
    /// Its next tick (database clock).
    pub next_due_at: DateTime<Utc>,
    /// The tick before its next: when it last fired, unless it was added, changed or
    /// resumed since (tenure does not store fires). `None` if its timing has no earlier tick.
    pub previous_tick: Option<DateTime<Utc>>,
}

/// A schedule as stored: the model of a `tenure_schedules` row
/// ([`crate::schema::tenure_schedules`]), for your own queries; [`list`] reads these.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable, QueryableByName)]
#[diesel(table_name = crate::schema::tenure_schedules)]
pub struct ScheduleRecord {
    /// Its name.
    pub name: String,
    /// Its cron expression (or `None` with an interval).
    pub cron: Option<String>,
    /// Its interval in microseconds (or `None` with a cron expression).
    pub interval_micros: Option<i64>,
    /// The time zone of its cron expression.
    pub time_zone: String,
    /// Its jobs' queue.
    pub queue: String,
    /// Their kind.
    pub kind: String,
    /// Their payload.
    pub payload: Vec<u8>,
    /// Their priority.
    pub priority: i32,
    /// Their attempts.
    pub max_attempts: i32,
    /// Their dedup key.
    pub dedup_key: Option<String>,
    /// Their concurrency-limit key.
    pub limit_key: Option<String>,
    /// Their concurrency limit.
    pub limit_max: Option<i32>,
    /// How long after each tick its job is due, in microseconds.
    pub delay_micros: i64,
    /// 1: fire every missed tick after downtime.
    pub catch_up: i32,
    /// 1: paused.
    pub paused: i32,
    /// Its next tick (database clock).
    pub next_due_at: DateTime<Utc>,
}

/// A due schedule and the database's now, as a scheduler reads them.
#[derive(QueryableByName)]
struct DueRow {
    #[diesel(embed)]
    record: ScheduleRecord,
    #[diesel(sql_type = Instant)]
    db_now: DateTime<Utc>,
}

impl ScheduleRecord {
    fn spec(&self) -> Result<Spec> {
        match (&self.cron, self.interval_micros) {
            (Some(cron), _) => Ok(Spec::Cron(cron.clone())),
            (None, Some(micros)) => Ok(Spec::Every(Duration::from_micros(
                u64::try_from(micros).unwrap_or(0),
            ))),
            (None, None) => Err(Error::Database(
                diesel::result::Error::DeserializationError(
                    format!(
                        "schedule {:?} has neither a cron expression nor an interval",
                        self.name
                    )
                    .into(),
                ),
            )),
        }
    }

    fn info(&self) -> Result<ScheduleInfo> {
        let spec = self.spec()?;
        let previous_tick = Timing::new(&spec, &self.time_zone)
            .ok()
            .and_then(|timing| timing.previous_before(self.next_due_at));
        Ok(ScheduleInfo {
            previous_tick,
            name: self.name.clone(),
            spec,
            time_zone: self.time_zone.clone(),
            queue: self.queue.clone(),
            kind: self.kind.clone(),
            dedup_key: self.dedup_key.clone(),
            limit: self.limit(),
            delay: Duration::from_micros(u64::try_from(self.delay_micros).unwrap_or(0)),
            catch_up: self.catch_up != 0,
            paused: self.paused != 0,
            next_due_at: self.next_due_at,
        })
    }

    fn limit(&self) -> Option<(String, u32)> {
        let key = self.limit_key.clone()?;
        Some((key, u32::try_from(self.limit_max?).unwrap_or(0)))
    }

    /// The job of the tick at `tick`: due at the tick plus the schedule's delay.
    fn job(&self, tick: DateTime<Utc>) -> Result<NewJob> {
        let due = tick
            .checked_add_signed(chrono::Duration::microseconds(self.delay_micros))
            .ok_or_else(|| {
                Error::invalid(
                    "schedule",
                    format!(
                        "{:?}: its tick {tick} plus its delay is out of range",
                        self.name
                    ),
                )
            })?;
        let mut job = NewJob::new(self.queue.clone(), self.kind.clone(), self.payload.clone())
            .priority(self.priority)
            .max_attempts(u32::try_from(self.max_attempts).unwrap_or(1))
            .at(due);
        if let Some(key) = &self.dedup_key {
            job = job.dedup_key(key.clone());
        }
        if let Some((key, max)) = self.limit() {
            job = job.limit(key, max);
        }
        Ok(job)
    }
}

const COLUMNS: &str = "name, cron, interval_micros, time_zone, queue, kind, payload, priority, \
    max_attempts, dedup_key, limit_key, limit_max, delay_micros, catch_up, paused, next_due_at, \
    {now} AS db_now";

const UPSERT_HEAD: &str = "\
    INSERT INTO tenure_schedules (name, cron, interval_micros, time_zone, queue, kind, payload, \
        priority, max_attempts, dedup_key, limit_key, limit_max, delay_micros, catch_up, \
        next_due_at) \
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

/// A replaced schedule keeps its next tick unless its timing changed (a stored schedule has
/// a cron expression or an interval, never both; an empty expression or a zero interval is
/// never stored, so they stand for "none").
const UPSERT_ON_CONFLICT: &str = " ON CONFLICT (name) DO UPDATE SET \
    next_due_at = CASE \
        WHEN COALESCE(tenure_schedules.cron, '') = COALESCE(excluded.cron, '') \
         AND COALESCE(tenure_schedules.interval_micros, 0) = COALESCE(excluded.interval_micros, 0) \
         AND tenure_schedules.time_zone = excluded.time_zone \
        THEN tenure_schedules.next_due_at ELSE excluded.next_due_at END, \
    cron = excluded.cron, interval_micros = excluded.interval_micros, \
    time_zone = excluded.time_zone, queue = excluded.queue, kind = excluded.kind, \
    payload = excluded.payload, priority = excluded.priority, \
    max_attempts = excluded.max_attempts, dedup_key = excluded.dedup_key, \
    limit_key = excluded.limit_key, limit_max = excluded.limit_max, \
    delay_micros = excluded.delay_micros, catch_up = excluded.catch_up";

/// As [`UPSERT_ON_CONFLICT`]. MySQL applies the assignments in order, each seeing the ones
/// before: `next_due_at` is decided first, on the old timing.
const UPSERT_ON_DUPLICATE_KEY: &str = " ON DUPLICATE KEY UPDATE \
    next_due_at = IF(cron <=> VALUES(cron) AND interval_micros <=> VALUES(interval_micros) \
        AND time_zone = VALUES(time_zone), next_due_at, VALUES(next_due_at)), \
    cron = VALUES(cron), interval_micros = VALUES(interval_micros), \
    time_zone = VALUES(time_zone), queue = VALUES(queue), kind = VALUES(kind), \
    payload = VALUES(payload), priority = VALUES(priority), \
    max_attempts = VALUES(max_attempts), dedup_key = VALUES(dedup_key), \
    limit_key = VALUES(limit_key), limit_max = VALUES(limit_max), \
    delay_micros = VALUES(delay_micros), catch_up = VALUES(catch_up)";

/// The due schedules, locked (other schedulers skip them; SQLite's IMMEDIATE transaction
/// serializes schedulers anyway), the longest overdue first, so that however many are due a
/// schedule waits at most a few calls (by name, the last names starved behind busy ones).
/// The table is small: no index on next_due_at, so MySQL reads it by primary key and locks
/// only what matches.
const DUE: &str = "WHERE paused = 0 AND next_due_at <= {now} ORDER BY next_due_at, name LIMIT 100";

/// The compare-and-set that fires a tick: only the scheduler that still sees the tick it
/// read moves the schedule on (and, in the same transaction, enqueues).
const ADVANCE: &str =
    "UPDATE tenure_schedules SET next_due_at = ? WHERE name = ? AND next_due_at = ?";

/// Creates or replaces a schedule. A new schedule's next tick is the first after the
/// database's now. A replaced one keeps its next tick, overdue or not, when its timing (cron
/// expression or interval, and time zone) is unchanged, so declaring schedules at every
/// start-up loses no tick missed while the program was down; a changed timing starts afresh
/// from now. A paused schedule stays paused. Joins the caller's transaction if there is one.
pub fn upsert<C: TenureConnection>(conn: &mut C, schedule: &Schedule) -> Result<()> {
    let (timing, delay) = schedule.validate()?;
    let now = crate::database_now(conn)?;
    let next = timing.next_after(now)?;
    let (cron, interval) = match &schedule.spec {
        Spec::Cron(expression) => (Some(expression.as_str()), None),
        Spec::Every(interval) => (None, Some(validate::ttl(*interval)?)),
    };
    let job = &schedule.job;
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    dispatch!(conn, c => {
        let syntax = c.syntax();
        let tail = match syntax.upsert {
            Upsert::OnConflictWhere => UPSERT_ON_CONFLICT,
            Upsert::OnDuplicateKey => UPSERT_ON_DUPLICATE_KEY,
        };
        let sql = syntax.render_with("{head}{tail}", &[("head", UPSERT_HEAD), ("tail", tail)]);
        statement(sql)
            .bind::<Text, _>(&schedule.name)
            .bind::<Nullable<Text>, _>(cron)
            .bind::<Nullable<BigInt>, _>(interval)
            .bind::<Text, _>(&schedule.time_zone)
            .bind::<Text, _>(&job.queue)
            .bind::<Text, _>(&job.kind)
            .bind::<Binary, _>(&job.payload)
            .bind::<Integer, _>(job.priority)
            .bind::<Integer, _>(job.max_attempts as i32)
            .bind::<Nullable<Text>, _>(job.dedup_key.as_deref())
            .bind::<Nullable<Text>, _>(job.first_limit().0)
            .bind::<Nullable<Integer>, _>(job.first_limit().1)
            .bind::<BigInt, _>(delay)
            .bind::<Integer, _>(i32::from(schedule.catch_up))
            .bind::<Instant, _>(next)
            .execute(c)
    })?;
    Ok(())
}

fn set_paused<C: TenureConnection>(conn: &mut C, name: &str, paused: bool) -> Result<bool> {
    validate::name("schedule name", name)?;
    let _turn = write_turn(conn)?;
    let changed = dispatch!(conn, c => {
        let sql = c.syntax().render("UPDATE tenure_schedules SET paused = ? WHERE name = ?");
        statement(sql).bind::<Integer, _>(i32::from(paused)).bind::<Text, _>(name).execute(c)
    })?;
    Ok(changed == 1)
}

/// Pauses a schedule (no ticks fire); returns whether it exists.
pub fn pause<C: TenureConnection>(conn: &mut C, name: &str) -> Result<bool> {
    set_paused(conn, name, true)
}

/// Resumes a paused schedule: the ticks it missed fire as after downtime (once, or each
/// with catch-up). Returns whether it exists.
pub fn resume<C: TenureConnection>(conn: &mut C, name: &str) -> Result<bool> {
    set_paused(conn, name, false)
}

/// Removes a schedule (its jobs already enqueued stay); returns whether it existed.
pub fn remove<C: TenureConnection>(conn: &mut C, name: &str) -> Result<bool> {
    validate::name("schedule name", name)?;
    let _turn = write_turn(conn)?;
    let removed = dispatch!(conn, c => {
        let sql = c.syntax().render("DELETE FROM tenure_schedules WHERE name = ?");
        statement(sql).bind::<Text, _>(name).execute(c)
    })?;
    Ok(removed == 1)
}

/// Every schedule, by name, with its next tick.
pub fn list<C: TenureConnection>(conn: &mut C) -> Result<Vec<ScheduleInfo>> {
    use crate::schema::tenure_schedules;
    let rows: Vec<ScheduleRecord> = dispatch!(conn, c => {
        tenure_schedules::table
            .order(tenure_schedules::name)
            .select(ScheduleRecord::as_select())
            .load(c)
    })?;
    rows.iter().map(ScheduleRecord::info).collect()
}

/// Fires every due tick of every schedule (by the database's clock) and returns how many jobs
/// it enqueued (a tick whose dedup key a live job already has enqueues none). Run it from any
/// number of schedulers, as often as the finest schedule needs: each tick is enqueued exactly
/// once. Needs a bare connection.
pub fn tick<C: TenureConnection>(conn: &mut C) -> Result<usize> {
    dispatch!(conn, c => bare_write_transaction(c, "firing schedules", fire_due))
}

fn fire_due<D: Dialect + TenureConnection>(c: &mut D) -> Result<usize> {
    let rows: Vec<DueRow> = dispatch!(c, c => {
        let syntax = c.syntax();
        let sql = syntax.render(&format!("SELECT {COLUMNS} FROM tenure_schedules {DUE}{{skip_locked}}"));
        statement(sql).load::<DueRow>(c)
    })?;
    let mut enqueued = 0;
    for DueRow {
        record: row,
        db_now,
    } in rows
    {
        let timing = match Timing::new(&row.spec()?, &row.time_zone) {
            Ok(timing) => timing,
            Err(e) => {
                // A schedule stored by an older tenure with something this one refuses: skip it.
                tracing::warn!(schedule = %row.name, error = %e, "schedule cannot be evaluated");
                continue;
            }
        };
        let due = match timing.due(row.next_due_at, db_now, row.catch_up != 0) {
            Ok(due) => due,
            Err(e) => {
                // Its ticks cannot be computed (a cron whose next tick the cron library cannot
                // find, as past a day a zone skipped): skip it; the others fire.
                tracing::warn!(schedule = %row.name, error = %e, "schedule's ticks cannot be computed");
                continue;
            }
        };
        let advanced = dispatch!(c, c => {
            statement(c.syntax().render(ADVANCE))
                .bind::<Instant, _>(due.next)
                .bind::<Text, _>(&row.name)
                .bind::<Instant, _>(row.next_due_at)
                .execute(c)
        })?;
        if advanced != 1 {
            continue; // another scheduler fired it
        }
        for at in due.fire {
            if !jobs::enqueue(c, &row.job(at)?)?.existing {
                enqueued += 1;
            }
        }
    }
    Ok(enqueued)
}

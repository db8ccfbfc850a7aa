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
//!   catches up, firing each missed tick.
//!
//! ```
//! # fn main() -> Result<(), dibs::Error> {
//! use std::time::Duration;
//! use dibs::jobs::NewJob;
//! use dibs::schedules::{self, Schedule};
//! let mut conn = dibs::AnyConnection::connect(":memory:")?;
//! dibs::run_migrations(&mut conn)?;
//! schedules::upsert(&mut conn, &Schedule::cron("nightly-report", "0 3 * * *", NewJob::new("reports", "nightly", vec![]))
//!     .time_zone("Europe/Lisbon"))?;
//! schedules::upsert(&mut conn, &Schedule::every("heartbeat", Duration::from_secs(60), NewJob::new("ops", "ping", vec![])))?;
//! let fired = schedules::tick(&mut conn)?; // run this from every scheduler, often
//! assert_eq!(fired, 0); // nothing due yet
//! # Ok(()) }
//! ```

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};

use crate::backend::{Dialect, Upsert, dispatch};
use crate::jobs::{self, NewJob};
use crate::sql_types::Instant;
use crate::transaction::bare_write_transaction;
use crate::{DibsConnection, Error, Result, validate};

/// When a schedule ticks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spec {
    /// A cron expression: 5 fields, or 6 with seconds first.
    Cron(String),
    /// A fixed interval (1 ms to 366 days).
    Every(Duration),
}

/// A recurring schedule: when it ticks, and the job it enqueues at each tick (due at the
/// tick's instant).
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

    fn validate(&self) -> Result<Timing> {
        validate::name("schedule name", &self.name)?;
        self.job.validate()?;
        Timing::new(&self.spec, &self.time_zone)
    }
}

/// A parsed schedule timing: what computes the ticks.
enum Timing {
    Cron(Box<croner::Cron>, chrono_tz::Tz),
    Every(chrono::Duration),
}

impl Timing {
    fn new(spec: &Spec, zone: &str) -> Result<Timing> {
        let tz = chrono_tz::Tz::from_str(zone).map_err(|_| {
            Error::invalid("time zone", format!("{zone:?} is not an IANA time zone"))
        })?;
        match spec {
            Spec::Cron(expression) => {
                let fields = expression.split_whitespace().count();
                if !(fields == 5 || fields == 6) {
                    return Err(Error::invalid(
                        "cron expression",
                        format!(
                            "{expression:?} has {fields} fields; use 5, or 6 with seconds first"
                        ),
                    ));
                }
                let cron = croner::parser::CronParser::builder()
                    .seconds(croner::parser::Seconds::Optional)
                    .build()
                    .parse(expression)
                    .map_err(|e| {
                        Error::invalid("cron expression", format!("{expression:?}: {e}"))
                    })?;
                Ok(Timing::Cron(Box::new(cron), tz))
            }
            Spec::Every(interval) => {
                let micros = validate::ttl(*interval).map_err(|_| {
                    Error::invalid(
                        "interval",
                        format!("{interval:?} is not between 1 ms and 366 days"),
                    )
                })?;
                Ok(Timing::Every(chrono::Duration::microseconds(micros)))
            }
        }
    }

    /// The first tick strictly after `after`.
    fn next_after(&self, after: DateTime<Utc>) -> Result<DateTime<Utc>> {
        match self {
            Timing::Every(interval) => Ok(after + *interval),
            Timing::Cron(cron, tz) => cron
                .find_next_occurrence(&after.with_timezone(tz), false)
                .map(|at| at.with_timezone(&Utc))
                .map_err(|e| Error::invalid("cron expression", format!("no next tick: {e}"))),
        }
    }

    /// Ticks from `due` (a tick) up to and including `now`, at most `cap` of them, and the
    /// first tick after those.
    fn due_ticks(
        &self,
        due: DateTime<Utc>,
        now: DateTime<Utc>,
        cap: usize,
    ) -> Result<(Vec<DateTime<Utc>>, DateTime<Utc>)> {
        let mut ticks = vec![due];
        let mut next = self.next_after(due)?;
        while next <= now && ticks.len() < cap {
            ticks.push(next);
            next = self.next_after(next)?;
        }
        Ok((ticks, next))
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
    /// Whether it fires every missed tick after downtime.
    pub catch_up: bool,
    /// Whether it is paused.
    pub paused: bool,
    /// Its next tick (database clock).
    pub next_due_at: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Nullable<Text>)]
    cron: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    interval_micros: Option<i64>,
    #[diesel(sql_type = Text)]
    time_zone: String,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Binary)]
    payload: Vec<u8>,
    #[diesel(sql_type = Integer)]
    priority: i32,
    #[diesel(sql_type = Integer)]
    max_attempts: i32,
    #[diesel(sql_type = Integer)]
    catch_up: i32,
    #[diesel(sql_type = Integer)]
    paused: i32,
    #[diesel(sql_type = Instant)]
    next_due_at: DateTime<Utc>,
    #[diesel(sql_type = Instant)]
    db_now: DateTime<Utc>,
}

impl Row {
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
        Ok(ScheduleInfo {
            name: self.name.clone(),
            spec: self.spec()?,
            time_zone: self.time_zone.clone(),
            queue: self.queue.clone(),
            kind: self.kind.clone(),
            catch_up: self.catch_up != 0,
            paused: self.paused != 0,
            next_due_at: self.next_due_at,
        })
    }

    fn job(&self) -> NewJob {
        NewJob::new(self.queue.clone(), self.kind.clone(), self.payload.clone())
            .priority(self.priority)
            .max_attempts(u32::try_from(self.max_attempts).unwrap_or(1))
    }
}

const COLUMNS: &str = "name, cron, interval_micros, time_zone, queue, kind, payload, priority, \
    max_attempts, catch_up, paused, next_due_at, {now} AS db_now";

const UPSERT_HEAD: &str = "\
    INSERT INTO dibs_schedules (name, cron, interval_micros, time_zone, queue, kind, payload, \
        priority, max_attempts, catch_up, next_due_at) \
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

const UPSERT_ON_CONFLICT: &str = " ON CONFLICT (name) DO UPDATE SET cron = excluded.cron, \
    interval_micros = excluded.interval_micros, time_zone = excluded.time_zone, \
    queue = excluded.queue, kind = excluded.kind, payload = excluded.payload, \
    priority = excluded.priority, max_attempts = excluded.max_attempts, \
    catch_up = excluded.catch_up, next_due_at = excluded.next_due_at";

const UPSERT_ON_DUPLICATE_KEY: &str = " ON DUPLICATE KEY UPDATE cron = VALUES(cron), \
    interval_micros = VALUES(interval_micros), time_zone = VALUES(time_zone), \
    queue = VALUES(queue), kind = VALUES(kind), payload = VALUES(payload), \
    priority = VALUES(priority), max_attempts = VALUES(max_attempts), \
    catch_up = VALUES(catch_up), next_due_at = VALUES(next_due_at)";

/// The due schedules, locked (other schedulers skip them; SQLite's IMMEDIATE transaction
/// serializes schedulers anyway). The table is small: no index on next_due_at, so MySQL
/// reads it by primary key and locks only what matches.
const DUE: &str = "WHERE paused = 0 AND next_due_at <= {now} ORDER BY name LIMIT 100";

/// The compare-and-set that fires a tick: only the scheduler that still sees the tick it
/// read moves the schedule on (and, in the same transaction, enqueues).
const ADVANCE: &str =
    "UPDATE dibs_schedules SET next_due_at = ? WHERE name = ? AND next_due_at = ?";

/// Creates or replaces a schedule; its next tick is computed from the database's now (so a
/// changed schedule starts afresh, and a paused one stays paused). Joins the caller's
/// transaction if there is one.
pub fn upsert<C: DibsConnection>(conn: &mut C, schedule: &Schedule) -> Result<()> {
    let timing = schedule.validate()?;
    let now = crate::database_now(conn)?;
    let next = timing.next_after(now)?;
    let (cron, interval) = match &schedule.spec {
        Spec::Cron(expression) => (Some(expression.as_str()), None),
        Spec::Every(interval) => (None, Some(validate::ttl(*interval)?)),
    };
    let job = &schedule.job;
    dispatch!(conn, c => {
        let syntax = c.syntax();
        let mut sql = syntax.render(UPSERT_HEAD);
        sql.push_str(match syntax.upsert {
            Upsert::OnConflictWhere => UPSERT_ON_CONFLICT,
            Upsert::OnDuplicateKey => UPSERT_ON_DUPLICATE_KEY,
        });
        diesel::sql_query(sql)
            .bind::<Text, _>(&schedule.name)
            .bind::<Nullable<Text>, _>(cron)
            .bind::<Nullable<BigInt>, _>(interval)
            .bind::<Text, _>(&schedule.time_zone)
            .bind::<Text, _>(&job.queue)
            .bind::<Text, _>(&job.kind)
            .bind::<Binary, _>(&job.payload)
            .bind::<Integer, _>(job.priority)
            .bind::<Integer, _>(job.max_attempts as i32)
            .bind::<Integer, _>(i32::from(schedule.catch_up))
            .bind::<Instant, _>(next)
            .execute(c)
    })?;
    Ok(())
}

fn set_paused<C: DibsConnection>(conn: &mut C, name: &str, paused: bool) -> Result<bool> {
    validate::name("schedule name", name)?;
    let changed = dispatch!(conn, c => {
        let sql = c.syntax().render("UPDATE dibs_schedules SET paused = ? WHERE name = ?");
        diesel::sql_query(sql).bind::<Integer, _>(i32::from(paused)).bind::<Text, _>(name).execute(c)
    })?;
    Ok(changed == 1)
}

/// Pauses a schedule (no ticks fire); returns whether it exists.
pub fn pause<C: DibsConnection>(conn: &mut C, name: &str) -> Result<bool> {
    set_paused(conn, name, true)
}

/// Resumes a paused schedule: the ticks it missed fire as after downtime (once, or each
/// with catch-up). Returns whether it exists.
pub fn resume<C: DibsConnection>(conn: &mut C, name: &str) -> Result<bool> {
    set_paused(conn, name, false)
}

/// Removes a schedule (its jobs already enqueued stay); returns whether it existed.
pub fn remove<C: DibsConnection>(conn: &mut C, name: &str) -> Result<bool> {
    validate::name("schedule name", name)?;
    let removed = dispatch!(conn, c => {
        let sql = c.syntax().render("DELETE FROM dibs_schedules WHERE name = ?");
        diesel::sql_query(sql).bind::<Text, _>(name).execute(c)
    })?;
    Ok(removed == 1)
}

/// Every schedule, by name, with its next tick.
pub fn list<C: DibsConnection>(conn: &mut C) -> Result<Vec<ScheduleInfo>> {
    let rows = dispatch!(conn, c => {
        let sql = c.syntax().render(&format!("SELECT {COLUMNS} FROM dibs_schedules ORDER BY name"));
        diesel::sql_query(sql).load::<Row>(c)
    })?;
    rows.iter().map(Row::info).collect()
}

/// Fires every due tick of every schedule (by the database's clock) and returns how many jobs
/// it enqueued. Run it from any number of schedulers, as often as the finest schedule needs:
/// each tick is enqueued exactly once. Needs a bare connection.
pub fn tick<C: DibsConnection>(conn: &mut C) -> Result<usize> {
    dispatch!(conn, c => bare_write_transaction(c, "firing schedules", fire_due))
}

fn fire_due<D: Dialect + DibsConnection>(c: &mut D) -> Result<usize> {
    let rows: Vec<Row> = dispatch!(c, c => {
        let syntax = c.syntax();
        let sql = syntax.render(&format!("SELECT {COLUMNS} FROM dibs_schedules {DUE}{{skip_locked}}"));
        diesel::sql_query(sql).load::<Row>(c)
    })?;
    let mut enqueued = 0;
    for row in rows {
        let timing = match Timing::new(&row.spec()?, &row.time_zone) {
            Ok(timing) => timing,
            Err(e) => {
                // A schedule stored by an older dibs with something this one refuses: skip it.
                tracing::warn!(schedule = %row.name, error = %e, "schedule cannot be evaluated");
                continue;
            }
        };
        let cap = if row.catch_up != 0 {
            MAX_TICKS_PER_CALL
        } else {
            usize::MAX
        };
        let (ticks, next) = timing.due_ticks(row.next_due_at, row.db_now, cap)?;
        let advanced = dispatch!(c, c => {
            diesel::sql_query(c.syntax().render(ADVANCE))
                .bind::<Instant, _>(next)
                .bind::<Text, _>(&row.name)
                .bind::<Instant, _>(row.next_due_at)
                .execute(c)
        })?;
        if advanced != 1 {
            continue; // another scheduler fired it
        }
        let fire: &[DateTime<Utc>] = if row.catch_up != 0 {
            &ticks
        } else {
            &ticks[ticks.len() - 1..]
        };
        for at in fire {
            jobs::enqueue(c, &row.job().at(*at))?;
            enqueued += 1;
        }
    }
    Ok(enqueued)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    fn cron(expression: &str, zone: &str) -> Timing {
        Timing::new(&Spec::Cron(expression.to_string()), zone).unwrap()
    }

    #[test]
    fn five_and_six_field_expressions() {
        let daily = cron("30 4 * * *", "UTC");
        assert_eq!(
            daily.next_after(at("2026-11-30T04:30:00Z")).unwrap(),
            at("2026-12-01T04:30:00Z")
        );
        let seconds = cron("*/15 * * * * *", "UTC");
        assert_eq!(
            seconds.next_after(at("2026-11-30T04:30:01Z")).unwrap(),
            at("2026-11-30T04:30:15Z")
        );
        let weekdays = cron("0 9 * * MON-FRI", "UTC");
        // 2026-11-28 is a Saturday.
        assert_eq!(
            weekdays.next_after(at("2026-11-28T10:00:00Z")).unwrap(),
            at("2026-11-30T09:00:00Z")
        );
    }

    #[test]
    fn time_zones_and_dst() {
        let nine = cron("0 9 * * *", "America/New_York");
        // EDT (UTC-4) in October, EST (UTC-5) in December.
        assert_eq!(
            nine.next_after(at("2026-10-01T00:00:00Z")).unwrap(),
            at("2026-10-01T13:00:00Z")
        );
        assert_eq!(
            nine.next_after(at("2026-12-01T00:00:00Z")).unwrap(),
            at("2026-12-01T14:00:00Z")
        );
        // Spring forward, 2026-03-08: 02:30 does not exist; it fires at the first instant
        // after the gap (03:00 EDT = 07:00 UTC).
        let gap = cron("30 2 * * *", "America/New_York");
        assert_eq!(
            gap.next_after(at("2026-03-08T05:00:00Z")).unwrap(),
            at("2026-03-08T07:00:00Z")
        );
        // Fall back, 2026-11-01: 01:30 happens twice; it fires once, at the first (EDT).
        let overlap = cron("30 1 * * *", "America/New_York");
        let first = overlap.next_after(at("2026-11-01T04:00:00Z")).unwrap();
        assert_eq!(first, at("2026-11-01T05:30:00Z"));
        assert_eq!(
            overlap.next_after(first).unwrap(),
            at("2026-11-02T06:30:00Z")
        );
    }

    #[test]
    fn invalid_expressions_and_zones_are_typed_errors() {
        for bad in [
            "",
            "* * *",
            "61 * * * *",
            "* * * * * * * *",
            "every day",
            "0 9 * * FUNDAY",
        ] {
            let err = Timing::new(&Spec::Cron(bad.to_string()), "UTC")
                .err()
                .expect(bad);
            assert!(err.is_invalid_input(), "{bad:?}: {err:?}");
        }
        assert!(
            Timing::new(&Spec::Cron("0 9 * * *".into()), "Mars/Olympus")
                .err()
                .unwrap()
                .is_invalid_input()
        );
        assert!(
            Timing::new(&Spec::Every(Duration::ZERO), "UTC")
                .err()
                .unwrap()
                .is_invalid_input()
        );
    }

    #[test]
    fn missed_ticks_are_counted() {
        let every = Timing::Every(chrono::Duration::seconds(10));
        let (ticks, next) = every
            .due_ticks(
                at("2026-01-01T00:00:00Z"),
                at("2026-01-01T00:01:35Z"),
                usize::MAX,
            )
            .unwrap();
        assert_eq!(ticks.len(), 10);
        assert_eq!(next, at("2026-01-01T00:01:40Z"));
        let (capped, next) = every
            .due_ticks(at("2026-01-01T00:00:00Z"), at("2026-01-01T00:01:35Z"), 3)
            .unwrap();
        assert_eq!((capped.len(), next), (3, at("2026-01-01T00:00:30Z")));
    }
}

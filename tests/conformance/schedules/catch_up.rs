//! Schedules' calendars and catch-up: a leap day, DST in odd zones and a cron that only
//! ever falls in a DST gap, a 1 ms interval's capped catch-up, a 366-day interval.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, TimeZone, Timelike, Utc};
use diesel::prelude::*;
use tenure::jobs::NewJob;
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, TenureConnection};

use crate::common::{TestDb, concrete, conformance};

conformance!(
    a_leap_day_cron_ticks_on_february_29,
    catch_up_across_dst_in_odd_zones_fires_one_tick_per_local_day,
    catch_up_of_a_1_ms_schedule_fires_exactly_the_cap_of_consecutive_ticks,
    a_366_day_interval_catches_up_exactly,
    a_cron_that_only_ever_falls_in_a_dst_gap,
);

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

fn due_times(conn: &mut AnyConnection, queue: &str) -> Vec<DateTime<Utc>> {
    #[derive(QueryableByName)]
    struct Due {
        #[diesel(sql_type = tenure::sql_types::Instant)]
        due_at: DateTime<Utc>,
    }
    let sql = format!("SELECT due_at FROM tenure_jobs WHERE queue = '{queue}' ORDER BY due_at, id");
    concrete!(conn, c => diesel::sql_query(sql).load::<Due>(c))
        .unwrap()
        .into_iter()
        .map(|d| d.due_at)
        .collect()
}

fn next_due_at(conn: &mut AnyConnection, name: &str) -> DateTime<Utc> {
    schedules::list(conn)
        .unwrap()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no schedule {name:?}"))
        .next_due_at
}

/// Sets a schedule's next tick to an exact instant.
fn set_next_due(conn: &mut AnyConnection, name: &str, at: DateTime<Utc>) {
    let literal = match conn.backend() {
        Backend::Sqlite => at.format("'%Y-%m-%d %H:%M:%S%.3f'").to_string(),
        Backend::Postgres => at.format("'%Y-%m-%d %H:%M:%S%.6f+00'").to_string(),
        Backend::Mysql => at.format("'%Y-%m-%d %H:%M:%S%.6f'").to_string(),
    };
    let changed = diesel::sql_query(format!(
        "UPDATE tenure_schedules SET next_due_at = {literal} WHERE name = '{name}'"
    ))
    .execute(conn)
    .unwrap();
    assert_eq!(changed, 1);
    assert_eq!(next_due_at(conn, name), at, "the literal round-trips");
}

/// A cron that fires only on leap days is accepted, and its next tick is a February 29th.
fn a_leap_day_cron_ticks_on_february_29(backend: Backend) {
    use chrono::Datelike;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    schedules::upsert(
        &mut conn,
        &Schedule::cron("leap", "0 12 29 2 *", NewJob::new("q", "k", vec![]))
            .time_zone("Pacific/Kiritimati"),
    )
    .unwrap();
    let next = next_due_at(&mut conn, "leap").with_timezone(&chrono_tz::Pacific::Kiritimati);
    assert_eq!(
        (next.month(), next.day(), next.hour()),
        (2, 29, 12),
        "{next}"
    );
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0);
}

/// With catch-up, a daily cron down across DST changes in zones with odd rules fires once per
/// local day: Lord Howe's half-hour shift, Dublin's negative DST, São Paulo's midnight gap,
/// Santiago's midnight gap, Apia's skipped day (2011-12-30). Overlap ticks fire at their first
/// occurrence, gap ticks at the first instant after the gap.
fn catch_up_across_dst_in_odd_zones_fires_one_tick_per_local_day(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // (name, zone, cron, first tick, local hour:minute, expected instants)
    type Case = (
        &'static str,
        &'static str,
        &'static str,
        DateTime<Utc>,
        (u32, u32),
        Vec<DateTime<Utc>>,
    );
    let cases: Vec<Case> = vec![
        (
            "lord-howe-overlap",
            "Australia/Lord_Howe",
            "45 1 * * *",
            utc(2026, 3, 31, 14, 45, 0),
            (1, 45),
            // 2026-04-05 01:45 happens at +11 and then at +10:30: the first one.
            vec![utc(2026, 4, 4, 14, 45, 0), utc(2026, 4, 5, 15, 15, 0)],
        ),
        (
            "lord-howe-gap",
            "Australia/Lord_Howe",
            "15 2 * * *",
            utc(2026, 9, 29, 15, 45, 0),
            (2, 15),
            // 2026-10-04 02:15 does not exist (02:00 +10:30 -> 02:30 +11): 02:30 +11.
            vec![utc(2026, 10, 3, 15, 30, 0), utc(2026, 10, 4, 15, 15, 0)],
        ),
        (
            "dublin",
            "Europe/Dublin",
            "30 1 * * *",
            utc(2026, 3, 26, 1, 30, 0),
            (1, 30),
            vec![
                // 2026-03-29 01:30 does not exist: 02:00 IST.
                utc(2026, 3, 29, 1, 0, 0),
                utc(2026, 3, 30, 0, 30, 0),
                // 2026-10-25 01:30 happens twice: the first (IST).
                utc(2026, 10, 25, 0, 30, 0),
                utc(2026, 10, 26, 1, 30, 0),
            ],
        ),
        (
            "sao-paulo",
            "America/Sao_Paulo",
            "0 0 * * *",
            utc(2018, 10, 30, 3, 0, 0),
            (0, 0),
            // 2018-11-04 00:00 does not exist: 01:00 -02.
            vec![utc(2018, 11, 4, 3, 0, 0), utc(2018, 11, 5, 2, 0, 0)],
        ),
        (
            "santiago",
            "America/Santiago",
            "0 0 * * *",
            utc(2026, 3, 30, 3, 0, 0),
            (0, 0),
            vec![],
        ),
        (
            "apia",
            "Pacific/Apia",
            "0 12 * * *",
            utc(2011, 12, 24, 22, 0, 0),
            (12, 0),
            vec![],
        ),
    ];
    let mut failures = Vec::new();
    let mut fired_ok = Vec::new();
    // One schedule at a time, so that one failing zone does not hide the others.
    for (name, zone, cron, first, _, _) in &cases {
        schedules::upsert(
            &mut conn,
            &Schedule::cron(*name, *cron, NewJob::new(*name, "k", vec![]))
                .time_zone(*zone)
                .catch_up(true),
        )
        .unwrap();
        set_next_due(&mut conn, name, *first);
        match schedules::tick(&mut conn) {
            Ok(n) if n > 0 => fired_ok.push(*name),
            Ok(n) => failures.push(format!("{name} ({zone}, {cron:?}): tick fired {n}")),
            Err(e) => failures.push(format!(
                "{name} ({zone}, {cron:?}) from {first}: tick failed: {e}"
            )),
        }
        assert!(schedules::remove(&mut conn, name).unwrap());
    }
    for (name, zone, _, first, (hour, minute), expected) in &cases {
        if !fired_ok.contains(name) {
            continue;
        }
        let tz: chrono_tz::Tz = zone.parse().unwrap();
        let ticks = due_times(&mut conn, name);
        assert!(!ticks.is_empty(), "{name}: nothing fired");
        if ticks[0] != *first {
            failures.push(format!(
                "{name}: the first tick fired is {} not {first}",
                ticks[0]
            ));
        }
        for at in expected {
            if !ticks.contains(at) {
                failures.push(format!(
                    "{name}: expected a tick at {at}; near it: {:?}",
                    ticks
                        .iter()
                        .filter(|t| (**t - *at).num_days().abs() <= 1)
                        .collect::<Vec<_>>()
                ));
            }
        }
        for pair in ticks.windows(2) {
            let (a, b) = (pair[0].with_timezone(&tz), pair[1].with_timezone(&tz));
            let (da, db_) = (a.date_naive(), b.date_naive());
            let skipped_ok = *name == "apia"
                && da == NaiveDate::from_ymd_opt(2011, 12, 29).unwrap()
                && db_ == NaiveDate::from_ymd_opt(2011, 12, 31).unwrap();
            if db_ != da.succ_opt().unwrap() && !skipped_ok {
                failures.push(format!(
                    "{name}: tick {a} ({}) then {b} ({})",
                    pair[0], pair[1]
                ));
            }
        }
        for t in &ticks {
            let local = t.with_timezone(&tz);
            // Off the cron's wall-clock time only inside a gap (then after it, within 1 h).
            if (local.hour(), local.minute()) != (*hour, *minute) {
                let wanted = local.date_naive().and_hms_opt(*hour, *minute, 0).unwrap();
                if tz.from_local_datetime(&wanted).earliest().is_some() {
                    failures.push(format!(
                        "{name}: tick {local} ({t}) is not at {hour}:{minute:02}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// With catch-up, a 1 ms schedule down for 5 s has 5000 missed ticks: one call fires exactly
/// MAX_TICKS_PER_CALL of them, 1 ms apart, and leaves the schedule at the next one.
fn catch_up_of_a_1_ms_schedule_fires_exactly_the_cap_of_consecutive_ticks(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let ms = Duration::from_millis(1);
    schedules::upsert(
        &mut conn,
        &Schedule::every("ms", ms, NewJob::new("ms", "k", vec![])).catch_up(true),
    )
    .unwrap();
    let now = tenure::database_now(&mut conn).unwrap();
    // A whole millisecond (SQLite keeps milliseconds), a minute ago: 60,000 missed ticks.
    let first = DateTime::<Utc>::from_timestamp_millis(now.timestamp_millis() - 60_000).unwrap();
    set_next_due(&mut conn, "ms", first);
    let fired = schedules::tick(&mut conn).unwrap();
    assert_eq!(fired, schedules::MAX_TICKS_PER_CALL);
    let ticks = due_times(&mut conn, "ms");
    assert_eq!(ticks.len(), schedules::MAX_TICKS_PER_CALL);
    assert_eq!(ticks[0], first);
    for pair in ticks.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            chrono::Duration::milliseconds(1),
            "{pair:?}"
        );
    }
    assert_eq!(
        next_due_at(&mut conn, "ms"),
        first + chrono::Duration::milliseconds(1000)
    );
}

/// The longest interval, 366 days, down for 2.5 intervals with catch-up: three ticks, exactly
/// 366 days apart, and the next one 366 days after the last.
fn a_366_day_interval_catches_up_exactly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let interval = Duration::from_secs(366 * 86400);
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "leap-year",
            interval,
            NewJob::new("ly", "k", vec![]).delay(interval),
        )
        .catch_up(true),
    )
    .unwrap();
    let now = tenure::database_now(&mut conn).unwrap();
    let step = chrono::Duration::days(366);
    let first = DateTime::<Utc>::from_timestamp(now.timestamp() - 2 * 366 * 86400 - 183 * 86400, 0)
        .unwrap();
    set_next_due(&mut conn, "leap-year", first);
    assert_eq!(schedules::tick(&mut conn).unwrap(), 3);
    assert_eq!(
        due_times(&mut conn, "ly"),
        vec![first + step, first + step * 2, first + step * 3],
        "each tick's job is due a (366-day) delay after it"
    );
    assert_eq!(next_due_at(&mut conn, "leap-year"), first + step * 3);
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0);
}

/// A cron whose every tick falls in a spring-forward gap (02:30 on the second Sunday of March,
/// New York): each fires at the first instant after the gap (07:00 UTC). With catch-up, every
/// year's tick fires; without, after a long downtime the one job is the newest missed tick
/// (within the last year), not a stale one.
fn a_cron_that_only_ever_falls_in_a_dst_gap(backend: Backend) {
    use chrono::Datelike;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let tz = chrono_tz::America::New_York;
    for (name, catch_up) in [("gap-all", true), ("gap-once", false)] {
        schedules::upsert(
            &mut conn,
            &Schedule::cron(name, "30 2 * 3 0#2", NewJob::new(name, "k", vec![]))
                .time_zone("America/New_York")
                .catch_up(catch_up),
        )
        .expect("a cron with a next tick");
        let next = next_due_at(&mut conn, name).with_timezone(&tz);
        assert_eq!(
            (
                next.month(),
                next.weekday(),
                (next.day() - 1) / 7,
                next.hour(),
                next.minute()
            ),
            (3, chrono::Weekday::Sun, 1, 3, 0),
            "{name}: next tick {next}"
        );
        // 2010-03-14 was the second Sunday of March: 03:00 EDT = 07:00 UTC.
        set_next_due(&mut conn, name, utc(2010, 3, 14, 7, 0, 0));
    }
    let now = tenure::database_now(&mut conn).unwrap();
    let fired = schedules::tick(&mut conn).expect("firing gap-only crons");
    let all = due_times(&mut conn, "gap-all");
    let years: Vec<i32> = all.iter().map(|t| t.year()).collect();
    let expected_years: Vec<i32> = (2010..=now.year())
        .filter(|y| {
            // The year's second Sunday of March, 07:00 UTC, at or before now.
            let first = NaiveDate::from_ymd_opt(*y, 3, 1).unwrap();
            let offset = (7 - first.weekday().num_days_from_sunday()) % 7;
            let second = first + chrono::Duration::days(i64::from(offset) + 7);
            Utc.from_utc_datetime(&second.and_hms_opt(7, 0, 0).unwrap()) <= now
        })
        .collect();
    let once = due_times(&mut conn, "gap-once");
    assert!(
        years == expected_years
            && all.iter().all(|t| t.with_timezone(&tz).hour() == 3)
            && once.len() == 1
            && once[0] > now - chrono::Duration::days(366)
            && fired == all.len() + 1,
        "fired {fired}; catch-up ticks {all:?} (wanted one in each of {expected_years:?}); \
         without catch-up {once:?} (wanted the newest, within a year of {now})"
    );
}

//! Outside attacks on schedules, instants at the edges, lease releases and error classes.

use std::sync::mpsc;
use std::time::Duration;

use chrono::{DateTime, NaiveDate, TimeZone, Timelike, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob, Outcome, Retry};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, Error, LeaseGuard, TenureConnection, lease};

use crate::common::{TestDb, concrete, conformance, contest, count};

conformance!(
    crons_that_never_fire_are_refused_and_write_nothing,
    a_leap_day_cron_ticks_on_february_29,
    catch_up_across_dst_in_odd_zones_fires_one_tick_per_local_day,
    catch_up_of_a_1_ms_schedule_fires_exactly_the_cap_of_consecutive_ticks,
    a_366_day_interval_catches_up_exactly,
    a_schedule_changed_while_paused_stays_paused_and_starts_afresh,
    a_schedules_dedup_key_colliding_with_a_user_job_consumes_the_tick,
    concurrent_upserts_and_ticks_enqueue_each_caught_up_tick_once,
    leap_second_instants_are_stored_or_refused_as_invalid_input,
    the_last_nanosecond_of_9999_is_stored_as_year_9999,
    release_on_after_the_lease_was_lost_returns_false_and_spares_the_new_holder,
    release_after_the_lease_was_lost_returns_false_promptly,
    a_lock_wait_timeout_is_retryable_not_outcome_unknown,
    an_uncapped_backoff_refuses_only_invalid_input_and_writes_nothing,
    one_uncomputable_schedule_does_not_block_the_others,
    a_cron_that_only_ever_falls_in_a_dst_gap,
    a_commit_on_a_killed_connection_is_outcome_unknown,
    a_call_on_a_connection_killed_while_idle_is_outcome_unknown,
    dropping_a_guard_inside_its_verify_transaction_does_not_hang,
    a_schedule_sorted_after_a_hundred_busy_ones_still_fires,
    migrations_race_raw_connections_and_version_reads_in_transactions,
);

/// Generous: none of these waits is expected to come near it, however loaded the machine.
const BOUND: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    receiver
        .recv_timeout(BOUND)
        .unwrap_or_else(|e| panic!("{what} did not return within {BOUND:?}: {e}"))
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

/// Cron expressions that match no date at all (February 30th, April 31st) cannot have a next
/// tick: upsert refuses them as invalid input, promptly, and stores nothing.
fn crons_that_never_fire_are_refused_and_write_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url().to_string();
    bounded("upserts of never-firing crons", move || {
        let mut conn = AnyConnection::connect(&url).unwrap();
        for (expression, zone) in [
            ("0 0 30 2 *", "UTC"),
            ("0 0 31 4 *", "UTC"),
            ("0 0 31 2,4,6,9,11 *", "Pacific/Kiritimati"),
            ("0 0 0 30 2 *", "America/New_York"),
            ("59 59 23 31 11 *", "Australia/Lord_Howe"),
        ] {
            let schedule =
                Schedule::cron("never", expression, NewJob::new("q", "k", vec![])).time_zone(zone);
            let err = schedules::upsert(&mut conn, &schedule)
                .expect_err(&format!("{expression:?} never fires, yet was accepted"));
            assert!(err.is_invalid_input(), "{expression:?}: {err:?}");
        }
        assert_eq!(
            count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_schedules"),
            0
        );
    });
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

/// A schedule redeclared with a new timing while paused stays paused, and its next tick is
/// computed afresh: resuming fires nothing of the old, overdue timing.
fn a_schedule_changed_while_paused_stays_paused_and_starts_afresh(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("p", "k", vec![]);
    schedules::upsert(
        &mut conn,
        &Schedule::every("p", Duration::from_secs(10), job()),
    )
    .unwrap();
    assert!(schedules::pause(&mut conn, "p").unwrap());
    set_next_due(&mut conn, "p", utc(2020, 1, 1, 0, 0, 0));
    // Unchanged timing while paused: still paused, still overdue.
    schedules::upsert(
        &mut conn,
        &Schedule::every("p", Duration::from_secs(10), job()).catch_up(true),
    )
    .unwrap();
    assert!(schedules::list(&mut conn).unwrap()[0].paused);
    assert_eq!(next_due_at(&mut conn, "p"), utc(2020, 1, 1, 0, 0, 0));
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0, "paused");
    // Changed timing while paused: still paused, afresh.
    let now = tenure::database_now(&mut conn).unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::cron("p", "0 0 1 1 *", job()).catch_up(true),
    )
    .unwrap();
    assert!(schedules::list(&mut conn).unwrap()[0].paused);
    assert!(next_due_at(&mut conn, "p") > now);
    assert!(schedules::resume(&mut conn, "p").unwrap());
    assert_eq!(
        schedules::tick(&mut conn).unwrap(),
        0,
        "nothing of the old timing fires"
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
}

/// A user's job holding the dedup key a schedule's job uses: the tick enqueues nothing (as
/// documented), reports 0, moves the schedule on, and leaves the user's job as it was.
fn a_schedules_dedup_key_colliding_with_a_user_job_consumes_the_tick(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let user = jobs::enqueue(
        &mut conn,
        &NewJob::new("shared", "user", b"mine".to_vec())
            .dedup_key("k")
            .priority(7),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "s",
            Duration::from_secs(10),
            NewJob::new("shared", "sched", vec![]).dedup_key("k"),
        )
        .catch_up(true),
    )
    .unwrap();
    let now = tenure::database_now(&mut conn).unwrap();
    let first = DateTime::<Utc>::from_timestamp(now.timestamp() - 25, 0).unwrap();
    set_next_due(&mut conn, "s", first);
    assert_eq!(
        schedules::tick(&mut conn).unwrap(),
        0,
        "every tick found the user's job"
    );
    assert_eq!(
        next_due_at(&mut conn, "s"),
        first + chrono::Duration::seconds(30)
    );
    let stored = jobs::get(&mut conn, user.id).unwrap().unwrap();
    assert_eq!((stored.kind.as_str(), stored.priority), ("user", 7));
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 1);
}

/// Four schedulers racing on separate connections, two of them also redeclaring the same
/// (unchanged) schedule while they tick, over many rounds of ten missed ticks caught up:
/// every round's ten ticks are enqueued exactly once.
fn concurrent_upserts_and_ticks_enqueue_each_caught_up_tick_once(backend: Backend) {
    const THREADS: usize = 4;
    const ROUNDS: usize = 15;
    const MISSED: i64 = 10;
    let db = TestDb::migrated(backend);
    let mut judge_conn = db.connect();
    let interval = Duration::from_secs(1);
    let schedule = move |round: usize| {
        Schedule::every(
            "race",
            interval,
            NewJob::new(format!("r{round}"), "k", vec![]),
        )
        .catch_up(true)
    };
    schedules::upsert(&mut judge_conn, &schedule(0)).unwrap();
    let prepare = |conn: &mut AnyConnection, round: usize| {
        schedules::upsert(conn, &schedule(round)).unwrap();
        let now = tenure::database_now(conn).unwrap();
        // MISSED ticks, the newest a bit more than a second ago (whole seconds).
        let first = DateTime::<Utc>::from_timestamp(now.timestamp() - MISSED - 1, 0).unwrap();
        set_next_due(conn, "race", first);
        first
    };
    let mut first = prepare(&mut judge_conn, 0);
    let mut failures = Vec::new();
    contest(
        &db,
        THREADS,
        ROUNDS,
        move |round, i, conn| {
            let mut fired = 0;
            let mut errors = Vec::new();
            for _ in 0..3 {
                if i % 2 == 1 {
                    if let Err(e) = schedules::upsert(conn, &schedule(round)) {
                        errors.push(format!("upsert: {e}"));
                    }
                }
                match schedules::tick(conn) {
                    Ok(n) => fired += n,
                    Err(e) => errors.push(format!("tick: {e}")),
                }
            }
            (fired, errors)
        },
        |round, results| {
            let fired: usize = results.iter().map(|r| r.0).sum();
            let errors: Vec<_> = results.iter().flat_map(|r| r.1.clone()).collect();
            let ticks = due_times(&mut judge_conn, &format!("r{round}"));
            let mut distinct = ticks.clone();
            distinct.dedup();
            if !errors.is_empty()
                || distinct.len() != ticks.len()
                || fired != ticks.len()
                || ticks.first() != Some(&first)
                || (ticks.len() as i64) < MISSED
            {
                failures.push(format!(
                    "round {round}: {} jobs ({} distinct), fired {fired}, first {:?} (wanted {first}), errors {errors:?}",
                    ticks.len(), distinct.len(), ticks.first()
                ));
            }
            if round + 1 < ROUNDS {
                first = prepare(&mut judge_conn, round + 1);
            }
        },
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// chrono represents a leap second as nanoseconds past 1e9. Such an instant, within years 1
/// to 9999, enters through NewJob::at and Retry::At: it must be stored (as some instant of
/// that second) or refused as invalid input, never a database error or a corrupt row.
fn leap_second_instants_are_stored_or_refused_as_invalid_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let leap = utc(2016, 12, 31, 23, 59, 59)
        .with_nanosecond(1_500_000_000)
        .expect("a leap second");
    let mut failures = Vec::new();
    match jobs::enqueue(&mut conn, &NewJob::new("q", "leap", vec![]).at(leap)) {
        Err(e) if e.is_invalid_input() => {}
        Err(e) => failures.push(format!("enqueue at {leap:?}: {e:?}")),
        Ok(enqueued) => match jobs::get(&mut conn, enqueued.id) {
            Err(e) => failures.push(format!("enqueue accepted it; reading the job back: {e:?}")),
            Ok(job) => {
                let job = job.unwrap();
                let secs = job.due_at.timestamp();
                if !(utc(2016, 12, 31, 23, 59, 59).timestamp()
                    ..=utc(2017, 1, 1, 0, 0, 0).timestamp())
                    .contains(&secs)
                {
                    failures.push(format!("stored as {}", job.due_at));
                }
            }
        },
    }
    if let Err(e) = jobs::stats(&mut conn) {
        failures.push(format!("stats after it: {e:?}"));
    }
    if let Err(e) = jobs::claim(&mut conn, "q", 10, TTL) {
        failures.push(format!("claim on its queue after it: {e:?}"));
    }
    let mut conn2 = db.connect();
    let holder = jobs::enqueue(&mut conn2, &NewJob::new("r", "k", vec![])).unwrap();
    let job = jobs::claim(&mut conn2, "r", 1, TTL).unwrap().pop().unwrap();
    assert_eq!(job.id, holder.id);
    match jobs::fail(&mut conn2, job.claim(), "boom", Retry::At(leap)) {
        Err(e) if e.is_invalid_input() => {}
        Err(e) => failures.push(format!("fail with retry at {leap:?}: {e:?}")),
        Ok(_) => {
            if let Err(e) = jobs::get(&mut conn2, job.id) {
                failures.push(format!(
                    "fail accepted Retry::At(leap second); reading the job: {e:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The last representable nanosecond of year 9999 is inside the range: it is stored as an
/// instant of year 9999 (never rounded up into year 10000) and is never due.
fn the_last_nanosecond_of_9999_is_stored_as_year_9999(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let last = utc(9999, 12, 31, 23, 59, 59) + chrono::Duration::nanoseconds(999_999_999);
    let job = jobs::enqueue(&mut conn, &NewJob::new("q", "late", vec![]).at(last)).unwrap();
    let stored = jobs::get(&mut conn, job.id).unwrap().unwrap();
    assert_eq!(
        stored.due_at.timestamp(),
        utc(9999, 12, 31, 23, 59, 59).timestamp()
    );
    assert!(jobs::claim(&mut conn, "q", 1, TTL).unwrap().is_empty());
    jobs::stats(&mut conn).expect("stats read every stored instant");
    let first = utc(1, 1, 1, 0, 0, 0) + chrono::Duration::nanoseconds(1);
    let early = jobs::enqueue(&mut conn, &NewJob::new("q", "early", vec![]).at(first)).unwrap();
    let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![early.id]
    );
}

/// A guard whose lease was force-released and taken by someone else: release_on, in the
/// caller's transaction, says false and leaves the new holder's lease alone.
fn release_on_after_the_lease_was_lost_returns_false_and_spares_the_new_holder(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "lost", TTL, "first")
        .unwrap()
        .expect("free");
    let mut other = db.connect();
    assert!(lease::force_release(&mut other, "lost").unwrap());
    let thief = lease::try_take(&mut other, "lost", TTL, "second")
        .unwrap()
        .expect("free after the force release");
    let mut conn = pool.get().unwrap();
    let released = bounded("release_on after a loss", move || {
        tenure::transaction(&mut conn, |conn| {
            jobs::enqueue(conn, &NewJob::new("q", "k", vec![]))?;
            guard.release_on(conn)
        })
    });
    assert!(
        !released.expect("the transaction commits"),
        "it was no longer the guard's"
    );
    let info = lease::inspect(&mut other, "lost").unwrap().unwrap();
    assert!(info.held, "the new holder's lease was released: {info:?}");
    thief
        .verify(&mut other)
        .expect("the new holder still holds it");
    assert_eq!(
        count(&mut other, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        1
    );
}

/// release() of a guard whose lease was lost returns false, well within the release wait.
fn release_after_the_lease_was_lost_returns_false_promptly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "lost", TTL, "first")
        .unwrap()
        .expect("free");
    let mut other = db.connect();
    assert!(lease::force_release(&mut other, "lost").unwrap());
    let thief = lease::try_take(&mut other, "lost", TTL, "second")
        .unwrap()
        .expect("free");
    let released = bounded("release after a loss", move || guard.release());
    assert!(!released.expect("no error"), "it was no longer the guard's");
    thief
        .verify(&mut other)
        .expect("the new holder still holds it");
}

/// A call that gives up waiting for a row lock (PostgreSQL lock_timeout, MariaDB
/// innodb_lock_wait_timeout, SQLite busy_timeout) is retryable, and not "outcome unknown":
/// the connection is fine and nothing was applied.
fn a_lock_wait_timeout_is_retryable_not_outcome_unknown(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut holder = db.connect();
    let mut waiter = match backend {
        Backend::Sqlite => db.connect_with(
            &tenure::SessionSetup::default().busy_timeout(Duration::from_millis(200)),
        ),
        _ => db.connect(),
    };
    match backend {
        Backend::Postgres => waiter.batch_execute("SET lock_timeout = '300ms'").unwrap(),
        Backend::Mysql => waiter
            .batch_execute("SET SESSION innodb_lock_wait_timeout = 1")
            .unwrap(),
        Backend::Sqlite => {}
    }
    let lease = lease::try_take(&mut holder, "locked", TTL, "holder")
        .unwrap()
        .expect("free");
    let (sender, receiver) = mpsc::channel();
    tenure::transaction(&mut holder, |holder| {
        lease.verify(holder)?;
        if backend == Backend::Sqlite {
            // Make sure this transaction holds SQLite's write lock.
            jobs::enqueue(holder, &NewJob::new("q", "k", vec![]))?;
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let _ = sender.send(lease::force_release(&mut waiter, "locked"));
            });
            let outcome = receiver
                .recv_timeout(BOUND)
                .expect("the waiter gave up in time");
            let err = outcome.expect_err("the waiter got through a held row lock");
            assert!(
                err.is_retryable(),
                "a lock wait timeout is not retryable: {err:?}"
            );
            assert!(!err.is_outcome_unknown(), "{err:?}");
        });
        Ok::<_, Error>(())
    })
    .unwrap();
    // The connection is usable, and the lease still held.
    assert!(lease::inspect(&mut waiter, "locked").unwrap().unwrap().held);
}

/// A backoff with no cap (max = Duration::MAX) is accepted by fail for early attempts; once
/// its delay passes 366 days it must either be clamped or refused as invalid input, and in the
/// latter case the claim is left as it was.
fn an_uncapped_backoff_refuses_only_invalid_input_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).max_attempts(5))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "q", 1, TTL).unwrap().pop().unwrap();
    assert_eq!(job.id, id);
    let backoff = jobs::Backoff {
        base: Duration::from_secs(400 * 86400),
        max: Duration::MAX,
    };
    match jobs::fail(&mut conn, job.claim(), "boom", Retry::Backoff(backoff)) {
        Ok(outcome) => {
            assert_eq!(outcome, Outcome::Done);
            let stored = jobs::get(&mut conn, id).unwrap().unwrap();
            assert_eq!(stored.state, jobs::JobState::Waiting);
        }
        Err(e) => {
            assert!(e.is_invalid_input(), "{e:?}");
            let stored = jobs::get(&mut conn, id).unwrap().unwrap();
            assert_eq!(stored.state, jobs::JobState::Running);
            assert_eq!(stored.last_error, None);
        }
    }
}

/// One schedule whose ticks cannot be computed (a catching-up cron in Pacific/Apia, due just
/// before the day Samoa skipped, 2011-12-30) must not stop every other schedule from firing:
/// `tick` goes on with the others (as it does for a schedule it cannot parse).
fn one_uncomputable_schedule_does_not_block_the_others(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "a-healthy",
            Duration::from_secs(10),
            NewJob::new("healthy", "k", vec![]),
        ),
    )
    .unwrap();
    let now = tenure::database_now(&mut conn).unwrap();
    set_next_due(
        &mut conn,
        "a-healthy",
        DateTime::<Utc>::from_timestamp(now.timestamp() - 5, 0).unwrap(),
    );
    schedules::upsert(
        &mut conn,
        &Schedule::cron("z-apia", "0 12 * * *", NewJob::new("apia", "k", vec![]))
            .time_zone("Pacific/Apia")
            .catch_up(true),
    )
    .unwrap();
    set_next_due(&mut conn, "z-apia", utc(2011, 12, 24, 22, 0, 0));
    let outcome = schedules::tick(&mut conn);
    let healthy = due_times(&mut conn, "healthy").len();
    assert!(
        outcome.is_ok() && healthy == 1,
        "tick: {outcome:?}; the healthy schedule's jobs: {healthy}"
    );
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

/// The server-side id of a connection, and SQL that kills it and says whether it is gone.
fn killer(backend: Backend, victim: &mut AnyConnection) -> (String, String) {
    let id = count(
        victim,
        match backend {
            Backend::Postgres => "SELECT CAST(pg_backend_pid() AS BIGINT) AS n",
            _ => "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n",
        },
    );
    match backend {
        Backend::Postgres => (
            format!("SELECT pg_terminate_backend({id})"),
            format!("SELECT COUNT(*) AS n FROM pg_stat_activity WHERE pid = {id}"),
        ),
        _ => (
            format!("KILL {id}"),
            format!("SELECT COUNT(*) AS n FROM information_schema.processlist WHERE id = {id}"),
        ),
    }
}

fn kill_and_wait(admin: &mut AnyConnection, kill: &str, alive: &str) {
    admin.batch_execute(kill).unwrap();
    let until = std::time::Instant::now() + BOUND;
    while count(admin, alive) > 0 {
        assert!(
            std::time::Instant::now() < until,
            "the victim never went away"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The connection is killed inside a caller's tenure::transaction (after verify and some work),
/// so the COMMIT is sent on a dead connection: the caller cannot know whether the work
/// committed, and the error must say so (is_outcome_unknown).
fn a_commit_on_a_killed_connection_is_outcome_unknown(backend: Backend) {
    if backend == Backend::Sqlite {
        return; // no server, no KILL
    }
    let db = TestDb::migrated(backend);
    let mut victim = db.connect();
    let mut admin = db.connect();
    let (kill, alive) = killer(backend, &mut victim);
    let lease = lease::try_take(&mut victim, "l", TTL, "me")
        .unwrap()
        .expect("free");
    let err = tenure::transaction(&mut victim, |conn| {
        lease.verify(conn)?;
        jobs::enqueue(conn, &NewJob::new("q", "k", vec![]))?;
        kill_and_wait(&mut admin, &kill, &alive);
        Ok::<_, Error>(())
    })
    .expect_err("a commit on a killed connection succeeded");
    assert!(
        err.is_outcome_unknown(),
        "a lost COMMIT is not outcome-unknown: {err:?}"
    );
}

/// A connection killed while idle, then used by a tenure call: the call fails as outcome
/// unknown (the client cannot tell how far the statement got).
fn a_call_on_a_connection_killed_while_idle_is_outcome_unknown(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let db = TestDb::migrated(backend);
    let mut victim = db.connect();
    let mut admin = db.connect();
    let (kill, alive) = killer(backend, &mut victim);
    kill_and_wait(&mut admin, &kill, &alive);
    let err = jobs::enqueue(&mut victim, &NewJob::new("q", "k", vec![]))
        .expect_err("an enqueue on a killed connection succeeded");
    assert!(err.is_outcome_unknown(), "{err:?}");
    // A scheduler's connection killed while idle: its first tick after.
    let mut scheduler = db.connect();
    let (kill, alive) = killer(backend, &mut scheduler);
    kill_and_wait(&mut admin, &kill, &alive);
    let err = schedules::tick(&mut scheduler).expect_err("a tick on a killed connection");
    assert!(err.is_outcome_unknown(), "tick: {err:?}");
}

/// Dropping a guard inside the transaction that verified its lease releases like release():
/// it must not hang either.
fn dropping_a_guard_inside_its_verify_transaction_does_not_hang(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let guard = LeaseGuard::try_take_pooled(&pool, "dropped", TTL, "guard")
        .unwrap()
        .expect("the lease is free");
    let mut conn = pool.get().unwrap();
    bounded("a drop inside the verify transaction", move || {
        tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            drop(guard);
            Ok::<_, Error>(())
        })
    })
    .expect("the transaction commits");
    let mut conn = db.connect();
    let until = std::time::Instant::now() + BOUND;
    while lease::inspect(&mut conn, "dropped").unwrap().unwrap().held {
        assert!(
            std::time::Instant::now() < until,
            "the dropped guard's lease stays held"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// More than 100 schedules always due (1 ms intervals) and one more, overdue, whose name
/// sorts last: tick fires "every due tick of every schedule", so the last one fires too
/// within a few calls, and is never starved by the others.
fn a_schedule_sorted_after_a_hundred_busy_ones_still_fires(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for i in 0..100 {
        schedules::upsert(
            &mut conn,
            &Schedule::every(
                format!("a{i:03}"),
                Duration::from_millis(1),
                NewJob::new("busy", "k", vec![]),
            ),
        )
        .unwrap();
    }
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "zzz",
            Duration::from_secs(10),
            NewJob::new("last", "k", vec![]),
        ),
    )
    .unwrap();
    let now = tenure::database_now(&mut conn).unwrap();
    set_next_due(
        &mut conn,
        "zzz",
        DateTime::<Utc>::from_timestamp(now.timestamp() - 5, 0).unwrap(),
    );
    let mut fired = Vec::new();
    for _ in 0..10 {
        // At least 5 ms between calls: every 1 ms schedule is due again at each call.
        std::thread::sleep(Duration::from_millis(5));
        fired.push(schedules::tick(&mut conn).unwrap());
    }
    let last = due_times(&mut conn, "last").len();
    assert_eq!(
        last, 1,
        "the schedule sorted last never fired in 10 calls (fired per call: {fired:?})"
    );
}

/// Many threads race run_migrations (on connections without session settings) against
/// schema_version read inside a caller's transaction, on fresh databases.
fn migrations_race_raw_connections_and_version_reads_in_transactions(backend: Backend) {
    const ROUNDS: usize = 6;
    const THREADS: usize = 6;
    let mut errors = Vec::new();
    for round in 0..ROUNDS {
        let db = TestDb::empty(backend);
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                // SQLite's raw connections have no busy timeout: they fail at once by design.
                let mut conn = if backend == Backend::Sqlite {
                    db.connect()
                } else {
                    db.connect_raw()
                };
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    if i % 3 == 2 {
                        tenure::transaction(&mut conn, |c| tenure::schema_version(c).map(|_| ()))
                    } else {
                        tenure::run_migrations(&mut conn).map(|_| ())
                    }
                })
            })
            .collect();
        for h in handles {
            if let Err(e) = h.join().expect("a racing thread panicked") {
                errors.push(format!("round {round}: {e:?}"));
            }
        }
        if errors.is_empty() {
            assert!(tenure::schema_version(&mut db.connect()).unwrap().is_some());
            assert!(
                tenure::run_migrations(&mut db.connect())
                    .unwrap()
                    .is_empty()
            );
        }
    }
    assert!(errors.is_empty(), "{errors:#?}");
}

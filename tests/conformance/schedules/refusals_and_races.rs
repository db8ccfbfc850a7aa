//! Schedules refused or changed: crons that never fire, one schedule that cannot be computed
//! among others, changes while paused, a dedup key shared with a user's job, upserts racing
//! ticks, and a schedule sorted after a hundred busy ones.

use std::sync::mpsc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use diesel::prelude::*;
use tenure::jobs::{self, NewJob};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, TenureConnection};

use crate::common::{TestDb, concrete, conformance, contest, count};

conformance!(
    crons_that_never_fire_are_refused_and_write_nothing,
    a_schedule_changed_while_paused_stays_paused_and_starts_afresh,
    a_schedules_dedup_key_colliding_with_a_user_job_consumes_the_tick,
    concurrent_upserts_and_ticks_enqueue_each_caught_up_tick_once,
    one_uncomputable_schedule_does_not_block_the_others,
    a_schedule_sorted_after_a_hundred_busy_ones_still_fires,
);

/// Generous: none of these waits is expected to come near it, however loaded the machine.
const BOUND: Duration = Duration::from_secs(30);

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
    // Each refusal is bounded on its own: proving one never fires is a search (seconds of
    // CPU in a debug build under load: five in one 30 s bound took 33 s once at load 14).
    for (expression, zone) in [
        ("0 0 30 2 *", "UTC"),
        ("0 0 31 4 *", "UTC"),
        ("0 0 31 2,4,6,9,11 *", "Pacific/Kiritimati"),
        ("0 0 0 30 2 *", "America/New_York"),
        ("59 59 23 31 11 *", "Australia/Lord_Howe"),
    ] {
        let url = db.url().to_string();
        bounded(&format!("the upsert of {expression:?}"), move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            let schedule =
                Schedule::cron("never", expression, NewJob::new("q", "k", vec![])).time_zone(zone);
            let err = schedules::upsert(&mut conn, &schedule)
                .expect_err(&format!("{expression:?} never fires, yet was accepted"));
            assert!(err.is_invalid_input(), "{expression:?}: {err:?}");
        });
    }
    assert_eq!(
        count(
            &mut db.connect(),
            "SELECT COUNT(*) AS n FROM tenure_schedules"
        ),
        0
    );
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
        // An hour apart: its next tick after the one it is due for cannot come during the
        // test, however slow the machine (10 s did, at load 10: it fired twice).
        &Schedule::every(
            "zzz",
            Duration::from_secs(3600),
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

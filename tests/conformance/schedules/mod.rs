//! Recurring schedules: every tick exactly once, however many schedulers run.

mod catch_up;
mod downtime;
mod refusals_and_races;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Timelike, Utc};
use diesel::prelude::*;
use tenure::jobs::NewJob;
use tenure::schedules::{self, Schedule, Spec};
use tenure::{AnyConnection, Backend, Error, TenureConnection};

use crate::common::{TestDb, concrete, conformance, count};

conformance!(
    three_schedulers_fire_every_tick_once,
    schedules_are_created_paused_listed_and_removed,
    bad_schedules_are_refused_and_write_nothing,
    a_worker_fires_schedules,
    a_schedules_job_keeps_its_limit_dedup_key_and_delay,
    a_schedule_lists_the_tick_before_its_next,
);

fn due_times(conn: &mut AnyConnection, queue: &str) -> Vec<DateTime<Utc>> {
    #[derive(QueryableByName)]
    struct Due {
        #[diesel(sql_type = tenure::sql_types::Instant)]
        due_at: DateTime<Utc>,
    }
    let sql = format!("SELECT due_at FROM tenure_jobs WHERE queue = '{queue}' ORDER BY due_at");
    concrete!(conn, c => diesel::sql_query(sql).load::<Due>(c))
        .unwrap()
        .into_iter()
        .map(|d| d.due_at)
        .collect()
}

fn three_schedulers_fire_every_tick_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let interval = Duration::from_millis(200);
    schedules::upsert(
        &mut conn,
        // Every missed tick too: a scheduler stalled on a busy machine then fires what it
        // missed, so every tick is in the count whatever the machine's speed.
        &Schedule::every("fast", interval, NewJob::new("ticks", "tick", vec![])).catch_up(true),
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let mut c = db.connect();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut fired = 0;
                while !stop.load(Ordering::SeqCst) {
                    fired += schedules::tick(&mut c).expect("a scheduler never fails");
                    std::thread::sleep(Duration::from_millis(7));
                }
                fired
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    let fired: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let ticks = due_times(&mut conn, "ticks");
    let total: usize = fired.iter().sum();
    assert_eq!(ticks.len(), total);
    // 3 s of a 200 ms schedule: about 15 ticks, more when the threads' start was slow (a busy
    // machine; the count from the upsert to the stop is what it is). No tick fired before
    // its time by the database's clock, and none missing or doubled (the spacing, below).
    assert!(ticks.len() >= 5, "{} ticks: {ticks:?}", ticks.len());
    let now = tenure::database_now(&mut conn).unwrap();
    assert!(
        ticks.last().is_some_and(|last| *last <= now),
        "a tick fired before its time (now {now}): {ticks:?}"
    );
    for pair in ticks.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            chrono::Duration::milliseconds(200),
            "a tick missing or doubled: {ticks:?}"
        );
    }
    println!(
        "{backend} 3 schedulers x 3 s on a 200 ms schedule: {} ticks, each enqueued once (fired per scheduler: {fired:?})",
        ticks.len()
    );
}

/// Moves a schedule's next tick `ticks_ago` intervals (minus half of one) into the past.
fn pretend_downtime(conn: &mut AnyConnection, name: &str, interval: Duration, ticks_ago: u32) {
    let seconds = interval.as_secs_f64() * (f64::from(ticks_ago) - 0.5);
    let at = match conn.backend() {
        Backend::Postgres => format!("statement_timestamp() - interval '{seconds} seconds'"),
        Backend::Mysql => format!(
            "UTC_TIMESTAMP(6) - INTERVAL {} MICROSECOND",
            (seconds * 1e6) as i64
        ),
        Backend::Sqlite => format!("strftime('%Y-%m-%d %H:%M:%f', 'now', '-{seconds} seconds')"),
    };
    let changed = diesel::sql_query(format!(
        "UPDATE tenure_schedules SET next_due_at = {at} WHERE name = '{name}'"
    ))
    .execute(conn)
    .unwrap();
    assert_eq!(changed, 1);
}

fn schedules_are_created_paused_listed_and_removed(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = NewJob::new("reports", "nightly", b"{}".to_vec());
    schedules::upsert(
        &mut conn,
        &Schedule::cron("nightly", "0 3 * * *", job.clone()).time_zone("Europe/Lisbon"),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "ping",
            Duration::from_millis(100),
            NewJob::new("ops", "ping", vec![]),
        ),
    )
    .unwrap();
    let listed = schedules::list(&mut conn).unwrap();
    assert_eq!(
        listed.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        vec!["nightly", "ping"]
    );
    assert_eq!(listed[0].spec, Spec::Cron("0 3 * * *".into()));
    assert_eq!(listed[0].time_zone, "Europe/Lisbon");
    assert_eq!(listed[1].spec, Spec::Every(Duration::from_millis(100)));
    // Update: same name, new spec.
    schedules::upsert(&mut conn, &Schedule::cron("nightly", "0 4 * * *", job)).unwrap();
    assert_eq!(
        schedules::list(&mut conn).unwrap()[0].spec,
        Spec::Cron("0 4 * * *".into())
    );
    // Paused: no ticks; resumed: the missed ones fire once.
    assert!(schedules::pause(&mut conn, "ping").unwrap());
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0);
    assert!(schedules::list(&mut conn).unwrap()[1].paused);
    assert!(schedules::resume(&mut conn, "ping").unwrap());
    assert_eq!(schedules::tick(&mut conn).unwrap(), 1);
    assert!(schedules::remove(&mut conn, "ping").unwrap());
    assert!(!schedules::remove(&mut conn, "ping").unwrap());
    assert!(!schedules::pause(&mut conn, "ping").unwrap());
    assert_eq!(schedules::list(&mut conn).unwrap().len(), 1);
    // Firing needs a bare connection.
    let refused = conn.transaction(schedules::tick).unwrap_err();
    assert!(
        matches!(refused, Error::InTransaction { .. }),
        "{refused:?}"
    );
}

fn bad_schedules_are_refused_and_write_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("q", "k", vec![]);
    let bad = vec![
        Schedule::cron("", "* * * * *", job()),
        Schedule::cron("s", "* * *", job()),
        Schedule::cron("s", "99 * * * *", job()),
        Schedule::cron("s", "0 9 * * *", job()).time_zone("Nowhere/Special"),
        Schedule::every("s", Duration::ZERO, job()),
        Schedule::every("s", Duration::from_secs(400 * 86400), job()),
        Schedule::every("s", Duration::from_secs(1), NewJob::new("", "k", vec![])),
    ];
    for schedule in &bad {
        let err = schedules::upsert(&mut conn, schedule).unwrap_err();
        assert!(err.is_invalid_input(), "{schedule:?}: {err:?}");
    }
    assert!(
        schedules::pause(&mut conn, "")
            .unwrap_err()
            .is_invalid_input()
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_schedules"),
        0
    );
}

/// A worker that runs schedules fires them and runs their jobs.
fn a_worker_fires_schedules(backend: Backend) {
    use tenure::worker::{JobContext, Worker};
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    schedules::upsert(
        &mut pool.get().unwrap(),
        &Schedule::every(
            "w",
            Duration::from_millis(150),
            NewJob::new("sched", "tick", vec![]),
        ),
    )
    .unwrap();
    let worker = Worker::builder(pool.clone())
        .queue("sched")
        .threads(1)
        .poll_interval(Duration::from_secs(30))
        .run_schedules()
        .raw_handler("tick", |_: &JobContext, _: &[u8]| Ok(()))
        .start()
        .unwrap();
    let started = std::time::Instant::now();
    while worker.report().completed < 4 && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = started.elapsed();
    let report = worker.shutdown(Duration::from_secs(1));
    assert!(report.completed >= 4, "{report:?}");
    // No more ticks than time allows (one per 150 ms).
    let possible = (took.as_millis() / 150) as usize + 1;
    assert!(report.completed <= possible, "{report:?} in {took:?}");
}

/// The next tick of one schedule, as stored.
fn next_due_at(conn: &mut AnyConnection, name: &str) -> DateTime<Utc> {
    schedules::list(conn)
        .unwrap()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no schedule {name:?}"))
        .next_due_at
}

/// A schedule's job is enqueued with its concurrency limit, dedup key and delay at every
/// tick, missed ticks included: three missed ticks under `limit(key, 1)` run one at a time.
fn a_schedules_job_keeps_its_limit_dedup_key_and_delay(backend: Backend) {
    #[derive(QueryableByName)]
    struct Options {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        limit_key: Option<String>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Integer>)]
        limit_max: Option<i32>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        dedup_key: Option<String>,
    }
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let interval = Duration::from_secs(10);
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "limited",
            interval,
            NewJob::new("limited", "k", vec![]).limit("one-at-a-time", 1),
        )
        .catch_up(true),
    )
    .unwrap();
    let hour = Duration::from_secs(3600);
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "keyed",
            interval,
            NewJob::new("keyed", "k", vec![])
                .dedup_key("only-one-waiting")
                .delay(hour),
        )
        .catch_up(true),
    )
    .unwrap();
    pretend_downtime(&mut conn, "limited", interval, 3);
    pretend_downtime(&mut conn, "keyed", interval, 3);
    let first_keyed_tick = next_due_at(&mut conn, "keyed");
    // Three jobs under the limit; one under the dedup key (the other two ticks find it).
    assert_eq!(schedules::tick(&mut conn).unwrap(), 3 + 1);
    assert_eq!(due_times(&mut conn, "limited").len(), 3);
    let claimed = tenure::jobs::claim(&mut conn, "limited", 10, Duration::from_secs(60)).unwrap();
    assert_eq!(
        claimed.len(),
        1,
        "limit 1: one of the three missed ticks runs"
    );
    let mut options = |queue: &str| {
        let sql = format!(
            "SELECT limit_key, limit_max, dedup_key FROM tenure_jobs WHERE queue = '{queue}'"
        );
        diesel::sql_query(sql)
            .load::<Options>(&mut conn)
            .unwrap()
            .into_iter()
            .map(|o| (o.limit_key, o.limit_max, o.dedup_key))
            .collect::<Vec<_>>()
    };
    let limit = (Some("one-at-a-time".to_string()), Some(1), None);
    assert_eq!(
        options("limited"),
        vec![limit.clone(), limit.clone(), limit]
    );
    let key = (None, None, Some("only-one-waiting".to_string()));
    assert_eq!(options("keyed"), vec![key]);
    // The delay counts from the tick.
    assert_eq!(
        due_times(&mut conn, "keyed"),
        vec![first_keyed_tick + chrono::Duration::hours(1)]
    );
    // A fixed instant makes no sense for a recurring job: refused before any statement.
    let at = Schedule::every(
        "fixed",
        interval,
        NewJob::new("q", "k", vec![]).at(Utc::now()),
    );
    assert!(
        schedules::upsert(&mut conn, &at)
            .unwrap_err()
            .is_invalid_input()
    );
    // So are the options a job refuses.
    for job in [
        NewJob::new("q", "k", vec![]).limit("key", 0),
        NewJob::new("q", "k", vec![]).limit("", 1),
        NewJob::new("q", "k", vec![]).dedup_key(""),
        NewJob::new("q", "k", vec![]).delay(Duration::from_secs(400 * 86400)),
    ] {
        let err = schedules::upsert(&mut conn, &Schedule::every("bad", interval, job.clone()))
            .unwrap_err();
        assert!(err.is_invalid_input(), "{job:?}: {err:?}");
    }
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_schedules"),
        2
    );
}

/// What a dashboard shows as a schedule's last fire: the tick before its next, by interval
/// or by cron expression in its zone.
fn a_schedule_lists_the_tick_before_its_next(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("q", "k", vec![]);
    schedules::upsert(
        &mut conn,
        &Schedule::every("every", Duration::from_secs(90), job()),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::cron("hourly", "15 * * * *", job()).time_zone("Asia/Kolkata"),
    )
    .unwrap();
    let all = schedules::list(&mut conn).unwrap();
    let every = all.iter().find(|s| s.name == "every").unwrap();
    assert_eq!(
        every.previous_tick,
        Some(every.next_due_at - chrono::Duration::seconds(90))
    );
    let hourly = all.iter().find(|s| s.name == "hourly").unwrap();
    assert_eq!(
        hourly.previous_tick,
        Some(hourly.next_due_at - chrono::Duration::hours(1))
    );
    // Kolkata is UTC+5:30: minute 15 there is minute 45 in UTC.
    assert_eq!(hourly.next_due_at.minute(), 45);
}

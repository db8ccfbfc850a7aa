//! Recurring schedules: every tick exactly once, however many schedulers run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use dibs::jobs::NewJob;
use dibs::schedules::{self, Schedule, Spec};
use dibs::{AnyConnection, Backend, DibsConnection, Error};
use diesel::prelude::*;

use crate::support::{TestDb, concrete, conformance, count};

conformance!(
    three_schedulers_fire_every_tick_once,
    after_downtime_a_schedule_fires_once_or_catches_up,
    schedules_are_created_paused_listed_and_removed,
    bad_schedules_are_refused_and_write_nothing,
    a_worker_fires_schedules,
);

fn due_times(conn: &mut AnyConnection, queue: &str) -> Vec<DateTime<Utc>> {
    #[derive(QueryableByName)]
    struct Due {
        #[diesel(sql_type = dibs::sql_types::Instant)]
        due_at: DateTime<Utc>,
    }
    let sql = format!("SELECT due_at FROM dibs_jobs WHERE queue = '{queue}' ORDER BY due_at");
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
        &Schedule::every("fast", interval, NewJob::new("ticks", "tick", vec![])),
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
    // 3 s of a 200 ms schedule: 15 ticks, the last perhaps still in flight.
    assert!(
        (14..=15).contains(&ticks.len()),
        "{} ticks: {ticks:?}",
        ticks.len()
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
        "UPDATE dibs_schedules SET next_due_at = {at} WHERE name = '{name}'"
    ))
    .execute(conn)
    .unwrap();
    assert_eq!(changed, 1);
}

fn after_downtime_a_schedule_fires_once_or_catches_up(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let interval = Duration::from_secs(10);
    schedules::upsert(
        &mut conn,
        &Schedule::every("once", interval, NewJob::new("once", "k", vec![])),
    )
    .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every("all", interval, NewJob::new("all", "k", vec![])).catch_up(true),
    )
    .unwrap();
    pretend_downtime(&mut conn, "once", interval, 10);
    pretend_downtime(&mut conn, "all", interval, 10);
    assert_eq!(schedules::tick(&mut conn).unwrap(), 11);
    assert_eq!(
        due_times(&mut conn, "once").len(),
        1,
        "default: once for all the missed ticks"
    );
    let all = due_times(&mut conn, "all");
    assert_eq!(all.len(), 10, "catch-up: every missed tick");
    // Nothing more is due until the next tick.
    assert_eq!(schedules::tick(&mut conn).unwrap(), 0);
    let now = dibs::database_now(&mut conn).unwrap();
    for info in schedules::list(&mut conn).unwrap() {
        assert!(
            info.next_due_at > now && info.next_due_at <= now + chrono::Duration::seconds(10),
            "{info:?}"
        );
    }
    // The one job is the newest missed tick: one interval before the next.
    let once = schedules::list(&mut conn)
        .unwrap()
        .into_iter()
        .find(|s| s.name == "once")
        .unwrap();
    assert_eq!(
        due_times(&mut conn, "once")[0],
        once.next_due_at - chrono::Duration::seconds(10)
    );
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
        count(&mut conn, "SELECT COUNT(*) AS n FROM dibs_schedules"),
        0
    );
}

/// A worker that runs schedules fires them and runs their jobs.
fn a_worker_fires_schedules(backend: Backend) {
    use dibs::worker::{JobContext, Worker};
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

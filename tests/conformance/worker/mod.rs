//! Workers on threads: handlers, batching, wake-ups, shutdown, the builder, dropped
//! connections (heartbeats, timeouts and cancels: `heartbeats.rs`; claims whose answer was
//! lost: `lost_answers.rs`).

mod claims;
mod heartbeats;
mod liveness;
mod lost_answers;
mod maintenance;
mod retries;
mod runs;
mod shutdown;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, JobError, Report, Worker, WorkerHandle};
use tenure::{Backend, Pool};

use crate::common::{TestDb, conformance, count, poll_until, wait_for};

conformance!(
    four_threads_process_two_thousand_jobs_once,
    three_batching_workers_run_each_job_once,
    shutdown_gives_back_prefetched_jobs_unstarted,
    panics_retries_failures_and_bad_payloads,
    shutdown_finishes_within_grace_and_gives_back_the_rest,
    an_idle_worker_starts_a_new_job_promptly,
    the_builder_refuses_what_cannot_work,
);

fn pool(db: &TestDb) -> Pool {
    db.pool(8)
}

fn four_threads_process_two_thousand_jobs_once(backend: Backend) {
    const JOBS: usize = 2000;
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|i| NewJob::json("bulk", "count", &i).unwrap())
        .collect();
    let ids = jobs::enqueue_many(&mut pool.get().unwrap(), &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect::<Vec<i64>>();
    let runs: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let seen = runs.clone();
    let started = Clock::now();
    let worker = Worker::builder(pool.clone())
        .queue("bulk")
        .threads(4)
        .poll_interval(Duration::from_millis(50))
        .handler("count", move |ctx: &JobContext, _i: usize| {
            *seen.lock().unwrap().entry(ctx.id).or_default() += 1;
            Ok(())
        })
        .start()
        .unwrap();
    let report = wait_for(&worker, Duration::from_secs(50), |r| r.completed >= JOBS);
    let took = started.elapsed();
    let report_after = worker.shutdown(Duration::from_secs(5));
    assert_eq!(report.completed, JOBS, "{report:?}");
    assert_eq!(report_after.completed, JOBS);
    let runs = runs.lock().unwrap();
    for id in &ids {
        assert_eq!(
            runs.get(id),
            Some(&1),
            "job {id} ran {:?} times",
            runs.get(id)
        );
    }
    let mut conn = pool.get().unwrap();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'"
        ),
        JOBS as i64
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'"
        ),
        0
    );
    println!(
        "{backend} worker, 4 threads, {JOBS} jobs: each ran once, all completed, {:?} = {:.0} jobs/s",
        took,
        JOBS as f64 / took.as_secs_f64()
    );
}

/// Three workers (own pools) claim ahead and record completions in batches on one queue:
/// every job runs exactly once and is completed once.
fn three_batching_workers_run_each_job_once(backend: Backend) {
    const JOBS: usize = 3000;
    let db = TestDb::migrated(backend);
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("shared", "k", vec![]))
        .collect();
    jobs::enqueue_many(&mut db.connect(), &batch).unwrap();
    let runs: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let workers: Vec<WorkerHandle> = (0..3)
        .map(|_| {
            let seen = runs.clone();
            Worker::builder(db.pool(8))
                .queue("shared")
                .threads(4)
                .poll_interval(Duration::from_millis(20))
                .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
                    *seen.lock().unwrap().entry(ctx.id).or_default() += 1;
                    Ok(())
                })
                .start()
                .unwrap()
        })
        .collect();
    poll_until(Duration::from_secs(60), Duration::from_millis(10), || {
        (workers.iter().map(|w| w.report().completed).sum::<usize>() >= JOBS).then_some(())
    });
    let reports: Vec<Report> = workers
        .into_iter()
        .map(|w| w.shutdown(Duration::from_secs(5)))
        .collect();
    let completed: usize = reports.iter().map(|r| r.completed).sum();
    assert_eq!(completed, JOBS, "{reports:?}");
    assert!(reports.iter().all(|r| r.lost == 0), "{reports:?}");
    let runs = runs.lock().unwrap();
    assert_eq!(runs.len(), JOBS);
    assert!(runs.values().all(|n| *n == 1), "a job ran twice");
    assert_eq!(
        count(
            &mut db.connect(),
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed' AND attempt = 1"
        ),
        JOBS as i64
    );
}

/// A worker with one thread on short jobs claims ahead; at shutdown the jobs it claimed but
/// did not start go back to the queue unstarted (no attempt used), and none is left running.
fn shutdown_gives_back_prefetched_jobs_unstarted(backend: Backend) {
    const JOBS: usize = 400;
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("ahead", "k", vec![]))
        .collect();
    jobs::enqueue_many(&mut pool.get().unwrap(), &batch).unwrap();
    let runs: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let seen = runs.clone();
    let worker = Worker::builder(pool.clone())
        .queue("ahead")
        .threads(1)
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            *seen.lock().unwrap().entry(ctx.id).or_default() += 1;
            std::thread::sleep(Duration::from_millis(2));
            Ok(())
        })
        .start()
        .unwrap();
    wait_for(&worker, Duration::from_secs(20), |r| r.completed >= 30);
    let report = worker.shutdown(Duration::from_secs(5));
    assert!(
        report.given_back > 0,
        "a worker on 2 ms jobs claims ahead of its one thread: {report:?}"
    );
    let runs = runs.lock().unwrap();
    assert!(runs.values().all(|n| *n == 1), "a job ran twice");
    assert_eq!(runs.len(), report.completed, "{report:?}");
    let mut conn = pool.get().unwrap();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running'"
        ),
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting' AND attempt = 0"
        ),
        (JOBS - report.completed) as i64,
        "{report:?}"
    );
}

fn panics_retries_failures_and_bad_payloads(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let mut conn = pool.get().unwrap();
    let later = tenure::database_now(&mut conn).unwrap() + chrono::Duration::hours(1);
    let panics = jobs::enqueue(
        &mut conn,
        &NewJob::new("mix", "panic", b"1".to_vec()).max_attempts(1),
    )
    .unwrap()
    .id;
    let retry_at = jobs::enqueue(&mut conn, &NewJob::new("mix", "retry_at", b"1".to_vec()))
        .unwrap()
        .id;
    let fails = jobs::enqueue(&mut conn, &NewJob::new("mix", "fail", b"1".to_vec()))
        .unwrap()
        .id;
    let bad = jobs::enqueue(
        &mut conn,
        &NewJob::new("mix", "typed", b"not json".to_vec()),
    )
    .unwrap()
    .id;
    let fine = jobs::enqueue(
        &mut conn,
        &NewJob::new("mix", "typed", b"{\"n\": 7}".to_vec()).priority(10),
    )
    .unwrap()
    .id;
    #[derive(serde::Deserialize)]
    struct Typed {
        n: u32,
    }
    let worker = Worker::builder(pool.clone())
        .queue("mix")
        .threads(1)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("panic", |ctx: &JobContext, _: &[u8]| {
            panic!("boom in job {}", ctx.id)
        })
        .raw_handler("retry_at", move |_: &JobContext, _: &[u8]| {
            Err(JobError::retry_at("not yet", later))
        })
        .raw_handler("fail", |_: &JobContext, _: &[u8]| {
            Err(JobError::dead("never will"))
        })
        .handler("typed", |_: &JobContext, t: Typed| {
            assert_eq!(t.n, 7);
            Ok(())
        })
        .start()
        .unwrap();
    // One thread: the job after the panic ran on the thread that caught it.
    let report = wait_for(&worker, Duration::from_secs(20), |r| {
        r.completed + r.retried + r.dead >= 5
    });
    worker.shutdown(Duration::from_secs(5));
    assert_eq!(
        (
            report.completed,
            report.retried,
            report.dead,
            report.panicked
        ),
        (1, 1, 3, 1),
        "{report:?}"
    );
    let job = |id| jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
    let p = job(panics);
    assert_eq!(p.state, JobState::Dead);
    assert!(
        p.last_error
            .unwrap()
            .contains(&format!("panicked: boom in job {panics}"))
    );
    let r = job(retry_at);
    assert_eq!((r.state, r.attempt), (JobState::Waiting, 1));
    assert!(
        (r.due_at - later).num_milliseconds().abs() <= 1,
        "{} vs {later}",
        r.due_at
    );
    let f = job(fails);
    assert_eq!((f.state, f.attempt), (JobState::Dead, 1));
    let b = job(bad);
    assert_eq!(
        (b.state, b.attempt),
        (JobState::Dead, 1),
        "undecodable: dead at once, no retries"
    );
    assert!(b.last_error.unwrap().contains("does not decode"));
    assert_eq!(job(fine).state, JobState::Completed);
}

fn shutdown_finishes_within_grace_and_gives_back_the_rest(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let mut conn = pool.get().unwrap();
    let short = jobs::enqueue(&mut conn, &NewJob::new("sd", "short", vec![]))
        .unwrap()
        .id;
    let stuck = jobs::enqueue(&mut conn, &NewJob::new("sd", "stuck", vec![]))
        .unwrap()
        .id;
    let started = Arc::new(AtomicUsize::new(0));
    let (s1, s2) = (started.clone(), started.clone());
    let worker = Worker::builder(pool.clone())
        .queue("sd")
        .threads(2)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("short", move |_: &JobContext, _: &[u8]| {
            s1.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })
        .raw_handler("stuck", move |ctx: &JobContext, _: &[u8]| {
            s2.fetch_add(1, Ordering::SeqCst);
            poll_until(Duration::from_secs(20), Duration::from_millis(10), || {
                ctx.should_stop().then_some(())
            });
            Ok(())
        })
        .start()
        .unwrap();
    poll_until(Duration::from_secs(10), Duration::from_millis(10), || {
        (started.load(Ordering::SeqCst) >= 2).then_some(())
    });
    let report = worker.shutdown(Duration::from_secs(1));
    assert_eq!((report.completed, report.given_back), (1, 1), "{report:?}");
    assert_eq!(
        jobs::get(&mut conn, short).unwrap().unwrap().state,
        JobState::Completed
    );
    let given_back = jobs::get(&mut conn, stuck).unwrap().unwrap();
    assert_eq!(
        (given_back.state, given_back.attempt),
        (JobState::Waiting, 0),
        "no attempt used"
    );
    // Another worker takes it at once.
    let taken = Clock::now();
    let other = Worker::builder(pool.clone())
        .queue("sd")
        .threads(1)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("stuck", |_: &JobContext, _: &[u8]| Ok(()))
        .start()
        .unwrap();
    let report = wait_for(&other, Duration::from_secs(5), |r| r.completed == 1);
    other.shutdown(Duration::from_secs(1));
    assert_eq!(report.completed, 1);
    assert!(
        taken.elapsed() < Duration::from_secs(2),
        "{:?}",
        taken.elapsed()
    );
    assert_eq!(
        jobs::get(&mut conn, stuck).unwrap().unwrap().state,
        JobState::Completed
    );
}

/// CPU time this process has used, from /proc (Linux), in clock ticks (1/100 s).
fn cpu_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

fn an_idle_worker_starts_a_new_job_promptly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    // PostgreSQL: a 30 s poll interval, so only NOTIFY can start the job quickly. Elsewhere
    // the worker polls: 200 ms.
    let poll = if backend == Backend::Postgres {
        Duration::from_secs(30)
    } else {
        Duration::from_millis(200)
    };
    let started_at: Arc<Mutex<Option<Clock>>> = Arc::default();
    let mark = started_at.clone();
    let worker = Worker::builder(pool.clone())
        .queue("idle")
        .threads(1)
        .poll_interval(poll)
        .raw_handler("k", move |_: &JobContext, _: &[u8]| {
            *mark.lock().unwrap() = Some(Clock::now());
            Ok(())
        })
        .start()
        .unwrap();
    // Let the idle backoff grow (on PostgreSQL to a 2.56 s wait, longer than the bound).
    let idle_from = cpu_ticks();
    std::thread::sleep(Duration::from_secs(3));
    let idle_cpu = cpu_ticks() - idle_from;
    let enqueued = Clock::now();
    jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("idle", "k", vec![])).unwrap();
    let report = wait_for(&worker, Duration::from_secs(10), |r| r.completed == 1);
    worker.shutdown(Duration::from_secs(1));
    assert_eq!(report.completed, 1);
    let latency = started_at.lock().unwrap().expect("the job ran") - enqueued;
    // Expected: ~20-50 ms with NOTIFY (the listener checks every 20 ms), up to the poll
    // interval when polling; 10x margins.
    let bound = if backend == Backend::Postgres {
        Duration::from_secs(1)
    } else {
        poll * 10
    };
    assert!(latency < bound, "{latency:?}");
    println!(
        "{backend} idle worker (poll interval {poll:?}): enqueue-to-start {latency:?}; \
         idle CPU over 3 s: {idle_cpu} ticks of 10 ms ({:.1}% of a core)",
        idle_cpu as f64 / 3.0
    );
}

fn the_builder_refuses_what_cannot_work(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let ok = |_: &JobContext, _: &[u8]| Ok(());
    let attempts = vec![
        (
            "no queue",
            Worker::builder(pool.clone())
                .raw_handler("k", ok)
                .start()
                .err(),
        ),
        (
            "no handler",
            Worker::builder(pool.clone()).queue("q").start().err(),
        ),
        (
            "zero threads",
            Worker::builder(pool.clone())
                .queue("q")
                .threads(0)
                .raw_handler("k", ok)
                .start()
                .err(),
        ),
        (
            "pool too small",
            Worker::builder(db.pool(3))
                .queue("q")
                .threads(2)
                .raw_handler("k", ok)
                .start()
                .err(),
        ),
        (
            "empty kind",
            Worker::builder(pool.clone())
                .queue("q")
                .raw_handler("", ok)
                .start()
                .err(),
        ),
        (
            "bad queue",
            Worker::builder(pool.clone())
                .queue("")
                .raw_handler("k", ok)
                .start()
                .err(),
        ),
        (
            "zero timeout",
            Worker::builder(pool.clone())
                .queue("q")
                .raw_handler("k", ok)
                .timeout("k", Duration::ZERO)
                .start()
                .err(),
        ),
        (
            "timeout of unknown kind",
            Worker::builder(pool.clone())
                .queue("q")
                .raw_handler("k", ok)
                .timeout("x", Duration::from_secs(1))
                .start()
                .err(),
        ),
        (
            "tiny ttl",
            Worker::builder(pool.clone())
                .queue("q")
                .raw_handler("k", ok)
                .claim_ttl(Duration::from_millis(5))
                .start()
                .err(),
        ),
    ];
    for (what, err) in attempts {
        let err = err.unwrap_or_else(|| panic!("{what}: started"));
        assert!(err.is_invalid_input(), "{what}: {err:?}");
    }
}

/// The server drops every connection of the worker mid-run: the worker logs, reconnects and
/// finishes every job (at least once; a run whose completion was cut off is rescued).
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn survives_dropped_connections(backend: Backend) {
    use diesel::RunQueryDsl;
    use diesel::connection::SimpleConnection;
    const JOBS: usize = 300;
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("drop", "k", vec![]))
        .collect();
    let ids = jobs::enqueue_many(&mut pool.get().unwrap(), &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect::<Vec<i64>>();
    let runs: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let seen = runs.clone();
    let worker = Worker::builder(pool.clone())
        .queue("drop")
        .threads(4)
        .claim_ttl(Duration::from_millis(600))
        .poll_interval(Duration::from_millis(50))
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            *seen.lock().unwrap().entry(ctx.id).or_default() += 1;
            std::thread::sleep(Duration::from_millis(5));
            Ok(())
        })
        .start()
        .unwrap();
    wait_for(&worker, Duration::from_secs(20), |r| {
        r.completed >= JOBS / 3
    });
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pid: i64,
    }
    let mut admin = db.connect();
    let others = match backend {
        Backend::Postgres => {
            "SELECT CAST(pid AS BIGINT) AS pid FROM pg_stat_activity \
            WHERE datname = current_database() AND pid <> pg_backend_pid()"
        }
        _ => {
            "SELECT CAST(id AS SIGNED) AS pid FROM information_schema.processlist \
            WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        }
    };
    let pids = diesel::sql_query(others).load::<Pid>(&mut admin).unwrap();
    assert!(!pids.is_empty());
    for Pid { pid } in &pids {
        let kill = match backend {
            Backend::Postgres => format!("SELECT pg_terminate_backend({pid})"),
            _ => format!("KILL {pid}"),
        };
        // A connection may have gone on its own meanwhile.
        let _ = admin.batch_execute(&kill);
    }
    let report = wait_for(&worker, Duration::from_secs(30), |r| r.completed >= JOBS);
    worker.shutdown(Duration::from_secs(2));
    let mut conn = pool.get().unwrap();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'"
        ),
        JOBS as i64,
        "{report:?}"
    );
    let runs = runs.lock().unwrap();
    assert!(ids.iter().all(|id| runs.get(id).is_some_and(|n| *n >= 1)));
    println!(
        "{backend} worker survived {} dropped connections: {report:?}",
        pids.len()
    );
}

#[cfg(feature = "postgres")]
mod postgres_faults {
    #[test]
    fn survives_dropped_connections() {
        super::survives_dropped_connections(tenure::Backend::Postgres)
    }
}

#[cfg(feature = "mysql")]
mod mysql_faults {
    #[test]
    fn survives_dropped_connections() {
        super::survives_dropped_connections(tenure::Backend::Mysql)
    }
}

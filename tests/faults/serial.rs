//! Scenarios that cut connections or restart the database server. They run on the private
//! servers `scripts/test` starts (`TestDb::restartable`), one at a time (nextest's
//! `restarts` group), beside the rest of the suite, which uses the other servers. The restart
//! commands come from `TENURE_TEST_RESTART_POSTGRES` and `TENURE_TEST_RESTART_MYSQL` (set by
//! `scripts/test` for its private servers); a restart test fails loudly when one is unset.

#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use tenure::jobs::{self, JobState, NewJob, Outcome};
use tenure::worker::{JobContext, Worker};
use tenure::{AnyConnection, Backend, LeaseGuard};

use crate::common::{TestDb, count, poll_until, wait_until};

const TTL: Duration = Duration::from_secs(60);

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// This connection's id on the server (what `pg_terminate_backend` / `KILL` take).
fn connection_id(conn: &mut AnyConnection, backend: Backend) -> i64 {
    let sql = match backend {
        Backend::Postgres => "SELECT CAST(pg_backend_pid() AS BIGINT) AS id",
        _ => "SELECT CAST(CONNECTION_ID() AS SIGNED) AS id",
    };
    diesel::sql_query(sql).get_result::<Id>(conn).unwrap().id
}

/// Opens a transaction on `conn` and locks the rows of `table` matching `condition`.
fn lock_rows(conn: &mut AnyConnection, backend: Backend, table: &str, condition: &str) {
    let one = match backend {
        Backend::Postgres => "CAST(1 AS BIGINT)",
        _ => "CAST(1 AS SIGNED)",
    };
    conn.batch_execute("BEGIN").unwrap();
    let locked = diesel::sql_query(format!(
        "SELECT {one} AS id FROM {table} WHERE {condition} FOR UPDATE"
    ))
    .load::<Id>(conn)
    .unwrap();
    assert_eq!(locked.len(), 1);
}

/// Waits until connection `id` waits for a row lock in a statement starting with
/// `statement`, then kills it (only it: the test's own connection, by id).
fn kill_when_waiting(admin: &mut AnyConnection, backend: Backend, id: i64, statement: &str) {
    let waiting = match backend {
        Backend::Postgres => format!(
            "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE pid = {id} \
             AND wait_event_type = 'Lock' AND query LIKE '{statement}%'"
        ),
        // MariaDB waits for a lock on a row found by primary key while optimizing
        // (state "Statistics"), before the transaction shows in INNODB_TRX: a statement
        // still running after the lock was taken is waiting for it.
        _ => format!(
            "SELECT COUNT(*) AS n FROM information_schema.processlist \
             WHERE id = {id} AND info LIKE '{statement}%' AND time_ms > 100"
        ),
    };
    wait_until(
        &format!("connection {id} to wait for the lock"),
        Duration::from_secs(20),
        || (count(admin, &waiting) > 0).then_some(()),
    );
    let kill = match backend {
        Backend::Postgres => format!("SELECT pg_terminate_backend({id})"),
        _ => format!("KILL {id}"),
    };
    admin.batch_execute(&kill).unwrap();
}

/// A claim killed while it waits for a limit key's lock (held by the test) leaves nothing
/// half-applied: the job is still waiting, with no attempt used, and the next claim takes it.
fn a_claim_killed_mid_way_changes_nothing(backend: Backend) {
    let db = TestDb::restartable(backend);
    let mut admin = db.connect();
    let id = jobs::enqueue(&mut admin, &NewJob::new("q", "k", vec![]).limit("key", 5))
        .unwrap()
        .id;
    admin
        .batch_execute("INSERT INTO tenure_limit_keys (limit_key) VALUES ('key')")
        .unwrap();
    let mut holder = db.connect();
    lock_rows(
        &mut holder,
        backend,
        "tenure_limit_keys",
        "limit_key = 'key'",
    );
    let mut victim = db.connect();
    let victim_id = connection_id(&mut victim, backend);
    let claim = std::thread::spawn(move || jobs::claim(&mut victim, "q", 10, TTL));
    kill_when_waiting(
        &mut admin,
        backend,
        victim_id,
        "INSERT INTO tenure_limit_keys",
    );
    let error = claim
        .join()
        .unwrap()
        .expect_err("the claim's connection was killed");
    holder.batch_execute("ROLLBACK").unwrap();
    let job = jobs::get(&mut admin, id).unwrap().unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Waiting, 0), "{error}");
    let claimed = jobs::claim(&mut db.connect(), "q", 10, TTL).unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!((claimed[0].id, claimed[0].attempt), (id, 1));
    println!(
        "{backend} claim killed mid-way: {error}; job still waiting, attempt 0; claimed next time"
    );
}

/// A completion killed while it waits for the job's row lock (held by the test) leaves the
/// job running under the same claim; completing again with that claim succeeds.
fn a_completion_killed_mid_way_changes_nothing(backend: Backend) {
    let db = TestDb::restartable(backend);
    let mut admin = db.connect();
    jobs::enqueue(&mut admin, &NewJob::new("q", "k", vec![])).unwrap();
    let job = jobs::claim(&mut admin, "q", 1, TTL).unwrap().remove(0);
    let claim = job.claim();
    let mut holder = db.connect();
    lock_rows(
        &mut holder,
        backend,
        "tenure_jobs",
        &format!("id = {}", job.id),
    );
    let mut victim = db.connect();
    let victim_id = connection_id(&mut victim, backend);
    let complete = std::thread::spawn(move || jobs::complete(&mut victim, &[claim]));
    kill_when_waiting(
        &mut admin,
        backend,
        victim_id,
        "SELECT id, state, claim_token",
    );
    let error = complete
        .join()
        .unwrap()
        .expect_err("the completion's connection was killed");
    holder.batch_execute("ROLLBACK").unwrap();
    let now = jobs::get(&mut admin, job.id).unwrap().unwrap();
    assert_eq!(now.state, JobState::Running, "{error}");
    assert_eq!(now.attempt, 1);
    assert_eq!(
        jobs::complete(&mut admin, &[claim]).unwrap(),
        vec![Outcome::Done]
    );
    println!(
        "{backend} completion killed mid-way: {error}; job still running under its claim; completed next time"
    );
}

/// The database server restarts in the middle of a 5,000-job run while a pooled lease guard
/// (ttl 16 s, renewed every 5.3 s; a restart on a loaded machine took 5.8 s) is held: the worker reconnects and every job completes; the guard keeps the
/// lease (the restart is shorter than its ttl) and still holds it in the database.
fn survives_a_server_restart(backend: Backend) {
    const JOBS: usize = 5000;
    let variable = match backend {
        Backend::Postgres => "TENURE_TEST_RESTART_POSTGRES",
        _ => "TENURE_TEST_RESTART_MYSQL",
    };
    let restart = std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is unset: set it to the command that restarts the {backend} server (scripts/test does)")
    });
    let db = TestDb::restartable(backend);
    let pool = tenure::Pool::options()
        .max_size(10)
        .connection_timeout(Duration::from_secs(5))
        .open(db.url())
        .unwrap();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("restart", "k", vec![]))
        .collect();
    jobs::enqueue_many(&mut pool.get().unwrap(), &batch).unwrap();
    let ttl = Duration::from_secs(16);
    // Without fast takeover: the promise is an outage shorter than the ttl (with it, about
    // 8 s, which a restart on a loaded machine may exceed).
    let take = tenure::lease::Take::new("through-restart", ttl, "test").fast_takeover(false);
    let guard = LeaseGuard::take_pooled_as(&pool, &take)
        .unwrap()
        .expect("a free lease");
    let runs: Arc<Mutex<usize>> = Arc::default();
    let seen = runs.clone();
    let worker = Worker::builder(pool.clone())
        .queue("restart")
        .threads(4)
        .claim_ttl(Duration::from_secs(20))
        .poll_interval(Duration::from_millis(100))
        .raw_handler("k", move |_: &JobContext, _: &[u8]| {
            *seen.lock().unwrap() += 1;
            std::thread::sleep(Duration::from_millis(2));
            Ok(())
        })
        .start()
        .unwrap();
    while *runs.lock().unwrap() < JOBS / 5 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let restarted_at = Instant::now();
    let status = std::process::Command::new("sh")
        .args(["-c", &restart])
        .status()
        .expect("run the restart command");
    assert!(status.success(), "{restart}: {status}");
    let restart_took = restarted_at.elapsed();
    let until = Instant::now() + Duration::from_secs(120);
    let mut conn = reconnect(db.url());
    let mut left = 0;
    poll_until(
        until.saturating_duration_since(Instant::now()),
        Duration::from_millis(50),
        || {
            left = count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'",
            );
            (left == 0).then_some(())
        },
    )
    .unwrap_or_else(|| panic!("{left} jobs never completed after the restart"));
    let report = worker.shutdown(Duration::from_secs(5));
    let runs = *runs.lock().unwrap();
    // Past a whole ttl since the restart: the guard kept the lease only by renewing it on a
    // fresh connection.
    std::thread::sleep((ttl + ttl / 4).saturating_sub(restarted_at.elapsed()));
    assert!(restart_took < ttl / 2, "the restart took {restart_took:?}");
    assert!(guard.is_held(), "the guard lost a lease that never lapsed");
    let info = tenure::lease::inspect(&mut conn, "through-restart")
        .unwrap()
        .unwrap();
    assert_eq!(info.fence, guard.fence());
    assert!(guard.release().unwrap(), "the lease was still the guard's");
    println!(
        "{backend} restart ({restart_took:?}) mid-run: {JOBS} jobs completed, {} handler runs \
         ({} re-runs), {report:?}; the guard kept its lease",
        runs,
        runs - JOBS
    );
}

/// The server restarts while a worker process holds running and prefetched jobs (claim ttl
/// 60 s) beside a second worker process: every session ends, so both workers' locks are
/// free and their heartbeats stop for the restart's length. Neither is taken for dead: a
/// rescue waits, from when it first finds a lock free, for a live worker to take it again.
/// Every job the first worker held runs once, in it.
fn a_restart_does_not_make_live_workers_look_dead(backend: Backend) {
    let variable = match backend {
        Backend::Postgres => "TENURE_TEST_RESTART_POSTGRES",
        _ => "TENURE_TEST_RESTART_MYSQL",
    };
    let restart = std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is unset: set it to the command that restarts the {backend} server (scripts/test does)")
    });
    // Each stage is logged with its time, so that a run that hangs shows where.
    let began = Instant::now();
    let stage = |what: &str| eprintln!("[{:>6.1?}] {what}", began.elapsed());
    let (db, mut conn) = crate::recovery::setup_on(TestDb::restartable(backend), 20_000);
    stage("jobs enqueued");
    let (holder, held) = crate::recovery::start_holding(&db, &mut conn, u64::MAX);
    stage("the first worker holds its jobs");
    let mut other = crate::child::spawn("holding-worker", &[db.url(), "0"]);
    assert_eq!(other.next_report().as_deref(), Some("started"));
    stage("the second worker started");
    let holder_pid = i64::from(holder.pid());
    drop(conn);
    let restarted_at = Instant::now();
    let status = std::process::Command::new("sh")
        .args(["-c", &restart])
        .status()
        .expect("run the restart command");
    assert!(status.success(), "{restart}: {status}");
    let restart_took = restarted_at.elapsed();
    stage("the server restarted");
    let until = Instant::now() + Duration::from_secs(120);
    let mut conn = reconnect(db.url());
    let completed = poll_until(
        until.saturating_duration_since(Instant::now()),
        Duration::from_millis(100),
        || {
            (count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'",
            ) == 0)
                .then_some(())
        },
    );
    if completed.is_none() {
        let mut left = |state: &str| {
            count(
                &mut conn,
                &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = '{state}'"),
            )
        };
        let (waiting, running, dead) = (left("waiting"), left("running"), left("dead"));
        let lapsed = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses > 0",
        );
        let workers = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_workers");
        panic!(
            "the jobs never completed: {waiting} waiting, {running} running, {dead} dead, \
             {lapsed} lapsed; {workers} workers registered"
        );
    }
    stage("every job completed");
    let by_job = crate::recovery::starts(&mut conn);
    for id in &held {
        assert_eq!(
            by_job.get(id).map(Vec::as_slice),
            Some(&[holder_pid][..]),
            "job {id} ran once, in its own worker"
        );
    }
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses > 0"
        ),
        0
    );
    drop((holder, other));
    println!(
        "{backend} restart ({restart_took:?}) under two worker processes: the {} jobs one held \
         ran once, in it; no worker was taken for dead",
        held.len()
    );
}

/// A connection to the restarted server, once it takes one again (within 120 s).
fn reconnect(url: &str) -> AnyConnection {
    let mut refused = None;
    poll_until(
        Duration::from_secs(120),
        Duration::from_millis(200),
        || match AnyConnection::connect(url) {
            Ok(conn) => Some(conn),
            Err(e) => {
                refused = Some(e);
                None
            }
        },
    )
    .unwrap_or_else(|| {
        panic!(
            "the server did not come back: {}",
            refused.expect("a refused connect")
        )
    })
}

macro_rules! serial_backend {
    ($module:ident, $feature:literal, $backend:expr) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[test]
            fn a_claim_killed_mid_way_changes_nothing() {
                super::a_claim_killed_mid_way_changes_nothing($backend)
            }
            #[test]
            fn a_completion_killed_mid_way_changes_nothing() {
                super::a_completion_killed_mid_way_changes_nothing($backend)
            }
            #[test]
            fn survives_a_server_restart() {
                super::survives_a_server_restart($backend)
            }
            #[test]
            fn a_restart_does_not_make_live_workers_look_dead() {
                super::a_restart_does_not_make_live_workers_look_dead($backend)
            }
        }
    };
}

serial_backend!(postgres, "postgres", tenure::Backend::Postgres);
serial_backend!(mysql, "mysql", tenure::Backend::Mysql);

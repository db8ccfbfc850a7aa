//! Crash recovery across processes: a worker process holding running and prefetched jobs is
//! killed, stopped, or loses its lock connection. A dead worker's jobs run again within
//! seconds (its lock was released), never those of a worker that lives (its lock is held, or
//! it takes it again).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::child::{Spawned, now_text, spawn, sql};
use crate::common::{TestDb, conformance, count, poll_until, wait_until};

conformance!(
    a_killed_workers_jobs_run_again_within_seconds,
    a_stopped_worker_is_never_taken_for_dead,
);

#[cfg(feature = "postgres")]
mod postgres_sessions {
    #[test]
    fn a_worker_whose_lock_connection_is_killed_keeps_its_jobs() {
        super::a_worker_whose_lock_connection_is_killed_keeps_its_jobs(tenure::Backend::Postgres)
    }
}

#[cfg(feature = "mysql")]
mod mysql_sessions {
    #[test]
    fn a_worker_whose_lock_connection_is_killed_keeps_its_jobs() {
        super::a_worker_whose_lock_connection_is_killed_keeps_its_jobs(tenure::Backend::Mysql)
    }
}

/// The claim ttl of the holding workers: what a dead worker's jobs would wait for without
/// its lock telling its death.
const TTL: Duration = Duration::from_secs(60);
/// Jobs run first, so that the worker times its runs and claims 100 ahead.
const WARM_UP: usize = 300;
/// Jobs whose runs hold the worker's 4 threads.
const SLOW: usize = 4;
/// Jobs behind them: claimed ahead (prefetched), not started.
const TAIL: usize = 96;

/// A worker process of these scenarios: 4 threads, claim ttl 60 s, prefetch 100. A warm-up
/// run (payload `w`) returns at once, so that the worker's average run is short and it claims
/// its full prefetch ahead (about 20 ms of work, at most 100 jobs); every other run records
/// its start (job id, pid, database time) at once, then sleeps as many milliseconds as its
/// payload says, at most `cap`. Runs until killed.
pub fn holding_worker(url: &str, cap: u64) {
    let pool = Pool::options().max_size(8).open(url).expect("pool");
    let starts = pool.clone();
    let pid = std::process::id() as i64;
    let _worker = Worker::builder(pool)
        .queue("held")
        .threads(4)
        .prefetch(100)
        .claim_ttl(TTL)
        .poll_interval(Duration::from_millis(50))
        .raw_handler("hold", move |ctx: &JobContext, payload: &[u8]| {
            if payload == b"w" {
                return Ok(());
            }
            // One attempt each: a start that meets a server restart (a test of these restarts
            // one) is written again once the server is back, rather than failing the job.
            let written = poll_until(Duration::from_secs(60), Duration::from_millis(100), || {
                let mut conn = starts.get().ok()?;
                record_start(&mut conn, ctx.id, pid).ok()
            });
            if written.is_none() {
                // Once more, for the error it fails with.
                record_start(&mut *starts.get()?, ctx.id, pid)?;
            }
            let wanted: u64 = std::str::from_utf8(payload)
                .ok()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis(wanted.min(cap)));
            Ok(())
        })
        .start()
        .expect("start the worker");
    println!("TENURE started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The table of runs' starts that [`record_start`] writes.
pub(crate) fn create_fault_starts(conn: &mut AnyConnection, backend: Backend) {
    let text = if backend == Backend::Mysql {
        "VARCHAR(64)"
    } else {
        "TEXT"
    };
    conn.batch_execute(&format!(
        "CREATE TABLE fault_starts (job_id BIGINT NOT NULL, pid BIGINT NOT NULL, at {text} NOT NULL)"
    ))
    .unwrap();
}

/// Records in `fault_starts` that job `id` began in process `pid`, at the database's now.
pub(crate) fn record_start(conn: &mut AnyConnection, id: i64, pid: i64) -> QueryResult<()> {
    let backend = tenure::TenureConnection::backend(conn);
    let at = now_text(conn, backend)?;
    diesel::sql_query(sql(
        backend,
        "INSERT INTO fault_starts (job_id, pid, at) VALUES (?, ?, ?)",
    ))
    .bind::<BigInt, _>(id)
    .bind::<BigInt, _>(pid)
    .bind::<Text, _>(at)
    .execute(conn)?;
    Ok(())
}

/// The database with the starts table and the jobs: warm-up, slow (sleeping `slow_ms`),
/// tail; one attempt each (a kill must use none). Enqueued in that order: claimed in it.
pub(crate) fn setup(backend: Backend, slow_ms: u64) -> (TestDb, AnyConnection) {
    setup_on(TestDb::migrated(backend), slow_ms)
}

/// [`setup`] on a database of the caller's (a server a test may restart).
pub(crate) fn setup_on(db: TestDb, slow_ms: u64) -> (TestDb, AnyConnection) {
    let backend = db.backend;
    let mut conn = db.connect();
    create_fault_starts(&mut conn, backend);
    let job = |payload: String| NewJob::new("held", "hold", payload.into_bytes()).max_attempts(1);
    let batch: Vec<NewJob> = (0..WARM_UP)
        .map(|_| job("w".into()))
        .chain((0..SLOW).map(|_| job(slow_ms.to_string())))
        .chain((0..TAIL).map(|_| job("0".into())))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    (db, conn)
}

/// Starts the holding worker and waits until it holds what it will hold: its 4 threads on
/// the slow jobs, and as many of the tail as it claims ahead (between half its prefetch and
/// all of it: it claims again when fewer than half are left), unchanged for a second.
/// Returns it and the ids it holds.
pub(crate) fn start_holding(
    db: &TestDb,
    conn: &mut AnyConnection,
    cap: u64,
) -> (Spawned, HashSet<i64>) {
    let mut worker = spawn("holding-worker", &[db.url(), &cap.to_string()]);
    assert_eq!(worker.next_report().as_deref(), Some("started"));
    let mut last = (0, Instant::now());
    let (mut running, mut slow_started) = (0, 0);
    poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
        running = count(
            conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running'",
        );
        slow_started = count(
            conn,
            &format!("SELECT COUNT(*) AS n FROM fault_starts WHERE job_id > {WARM_UP}"),
        );
        if running != last.0 {
            last = (running, Instant::now());
        }
        let settled = last.1.elapsed() > Duration::from_secs(1);
        (settled && running > SLOW as i64 + 10 && slow_started >= SLOW as i64).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the worker never held its slow jobs and a prefetch: {running} running, \
             {slow_started} slow ones started"
        )
    });
    // Warm-up runs record no start, so they cannot be followed: only the slow jobs and the
    // tail are. A warm-up can still be held here, waiting in the worker behind the slow ones
    // (seen once under load on MariaDB: job 257 of 300 ran after the kill, in its own worker,
    // and the check found no start for it).
    let held = ids(
        conn,
        &format!("SELECT id FROM tenure_jobs WHERE state = 'running' AND id > {WARM_UP}"),
    );
    (worker, held)
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

fn ids(conn: &mut AnyConnection, query: &str) -> HashSet<i64> {
    diesel::sql_query(query)
        .load::<Id>(conn)
        .unwrap()
        .into_iter()
        .map(|row| row.id)
        .collect()
}

/// Every start recorded: job id -> the pids that started it.
pub(crate) fn starts(conn: &mut AnyConnection) -> HashMap<i64, Vec<i64>> {
    #[derive(QueryableByName)]
    struct Start {
        #[diesel(sql_type = BigInt)]
        job_id: i64,
        #[diesel(sql_type = BigInt)]
        pid: i64,
    }
    let mut by_job: HashMap<i64, Vec<i64>> = HashMap::new();
    for start in diesel::sql_query("SELECT job_id, pid FROM fault_starts")
        .load::<Start>(conn)
        .unwrap()
    {
        by_job.entry(start.job_id).or_default().push(start.pid);
    }
    by_job
}

/// A worker process (claim ttl 60 s) holding 4 running and 96 prefetched jobs is SIGKILLed
/// and a new one started at once: every job the dead process held runs again in the new
/// one well within half the ttl (its lock was released when it died), without using an
/// attempt (one each: none ends dead), each with one lapse and the death in its history.
fn a_killed_workers_jobs_run_again_within_seconds(backend: Backend) {
    let (db, mut conn) = setup(backend, 600_000);
    let (mut victim, held) = start_holding(&db, &mut conn, u64::MAX);
    let _ = victim.child.kill(); // SIGKILL
    let _ = victim.child.wait();
    let killed = Instant::now();
    // Its slow jobs run at once in the new worker (cap 0), so every held job can start.
    let mut successor = spawn("holding-worker", &[db.url(), "0"]);
    assert_eq!(successor.next_report().as_deref(), Some("started"));
    let successor_pid = i64::from(successor.pid());
    let bound = TTL / 2;
    let took = loop {
        let by_job = starts(&mut conn);
        let left = held
            .iter()
            .filter(|id| {
                !by_job
                    .get(id)
                    .is_some_and(|pids| pids.contains(&successor_pid))
            })
            .count();
        if left == 0 {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < bound,
            "{left} of the {} jobs the killed worker held did not run again within {bound:?} \
             (ttl {TTL:?})",
            held.len()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    wait_until(
        "the rescued jobs to complete",
        Duration::from_secs(30),
        || {
            (count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'",
            ) == 0)
                .then_some(())
        },
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE attempt <> 1"
        ),
        0,
        "a kill used an attempt"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses = 1"
        ),
        held.len() as i64
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_job_errors WHERE error LIKE '%worker holding the claim died%'"
        ),
        held.len() as i64,
        "each rescued run's history says its worker died"
    );
    // The dead worker's row is gone; the new worker's is there.
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_workers"),
        1
    );
    println!(
        "{backend} crash recovery: a worker holding {} jobs ({SLOW} running, {} claimed ahead; \
         claim ttl {TTL:?}) was killed; every one ran again in a new worker {took:.1?} after \
         the kill, no attempt used",
        held.len(),
        held.len() - SLOW
    );
}

/// A worker process holding running and prefetched jobs is SIGSTOPped for 10 s (its
/// heartbeat goes silent for longer than a killed worker's jobs take to run again) beside a
/// second worker of the same queue: none of its jobs runs in the other process while it is
/// stopped (its lock is held: a stopped process is not a dead one); after SIGCONT it runs
/// every one of them itself, each once.
fn a_stopped_worker_is_never_taken_for_dead(backend: Backend) {
    let (db, mut conn) = setup(backend, 12_000);
    let (holder, held) = start_holding(&db, &mut conn, u64::MAX);
    let mut other = spawn("holding-worker", &[db.url(), "0"]);
    assert_eq!(other.next_report().as_deref(), Some("started"));
    let (holder_pid, other_pid) = (i64::from(holder.pid()), i64::from(other.pid()));
    holder.signal("STOP");
    let stopped = Instant::now();
    while stopped.elapsed() < Duration::from_secs(10) {
        let by_job = starts(&mut conn);
        let elsewhere: Vec<i64> = held
            .iter()
            .filter(|id| by_job.get(id).is_some_and(|pids| pids.contains(&other_pid)))
            .copied()
            .collect();
        assert!(
            elsewhere.is_empty(),
            "jobs {elsewhere:?} ran in another process after {:?} while their worker was stopped",
            stopped.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let silent = count(
        &mut conn,
        &format!(
            "SELECT COUNT(*) AS n FROM tenure_workers WHERE pid = {holder_pid} AND heartbeat_at < {}",
            crate::common::now_sql(backend)
        ),
    );
    assert_eq!(silent, 1, "the stopped worker's row is there, silent");
    holder.signal("CONT");
    wait_until(
        "the stopped worker's jobs to complete",
        Duration::from_secs(60),
        || {
            (count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'",
            ) == 0)
                .then_some(())
        },
    );
    let by_job = starts(&mut conn);
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
    drop(other);
    println!(
        "{backend} stopped worker: {} jobs held ({SLOW} running, {} claimed ahead) through a \
         10 s SIGSTOP beside another worker; none ran elsewhere, all ran once after SIGCONT",
        held.len(),
        held.len() - SLOW
    );
}

/// A live worker's lock connection is killed on the server (as a restart, an operator or a
/// network reset would): its lock is free, but its heartbeat goes on through its other
/// connections, so a second worker does not take it for dead; it takes its lock again on a
/// new session within seconds, and runs every job it held, each once.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn a_worker_whose_lock_connection_is_killed_keeps_its_jobs(backend: Backend) {
    let (db, mut conn) = setup(backend, 8_000);
    let (holder, held) = start_holding(&db, &mut conn, u64::MAX);
    let mut other = spawn("holding-worker", &[db.url(), "0"]);
    assert_eq!(other.next_report().as_deref(), Some("started"));
    let (holder_pid, other_pid) = (i64::from(holder.pid()), i64::from(other.pid()));
    let worker = ids(
        &mut conn,
        &format!("SELECT id FROM tenure_workers WHERE pid = {holder_pid}"),
    );
    let worker = *worker.iter().next().expect("the holder is registered");
    let session = crate::common::worker_lock_session(&mut conn, backend, worker)
        .expect("the holder holds its lock");
    let kill = match backend {
        Backend::Postgres => format!("SELECT pg_terminate_backend({session})"),
        _ => format!("KILL {session}"),
    };
    conn.batch_execute(&kill).unwrap();
    let killed = Instant::now();
    let mut again = None;
    while killed.elapsed() < Duration::from_secs(8) {
        let by_job = starts(&mut conn);
        let elsewhere = held
            .iter()
            .filter(|id| by_job.get(id).is_some_and(|pids| pids.contains(&other_pid)))
            .count();
        assert_eq!(
            elsewhere,
            0,
            "jobs ran in another process after {:?}",
            killed.elapsed()
        );
        if again.is_none() {
            match crate::common::worker_lock_session(&mut conn, backend, worker) {
                Some(new) if new != session => again = Some((new, killed.elapsed())),
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, took) = again.expect("the worker took its lock again on a new session");
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_workers WHERE id = {worker} AND lock_free_since IS NULL"
            )
        ),
        1
    );
    poll_until(Duration::from_secs(60), Duration::from_millis(50), || {
        (count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'",
        ) == 0)
            .then_some(())
    })
    .expect("the worker's jobs never completed");
    let by_job = starts(&mut conn);
    for id in &held {
        assert_eq!(
            by_job.get(id).map(Vec::as_slice),
            Some(&[holder_pid][..]),
            "job {id} ran once, in its own worker"
        );
    }
    drop((holder, other));
    println!(
        "{backend} lock connection killed: the worker took its lock again after {took:.1?}; \
         its {} jobs ran once, in it",
        held.len()
    );
}

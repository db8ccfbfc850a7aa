//! V: how soon `jobs::wait` returns after a job ends, and what idle waiters cost the server.
//!
//! - V1. The job ends in the waiter's process (a worker's completion): from the handler's
//!   return to `enqueue_and_wait`'s (the finisher's commit and the in-process wake-up).
//! - V2. The job ends elsewhere (a completion by another connection that does not wake this
//!   process's waiters, as another process's would): from that commit to the waiter's return
//!   (at most one poll interval, 25 ms, plus a read).
//! - V3. 500 waiters on jobs that do not end, for 5 s: the statements a second the server
//!   counted for this database meanwhile (PostgreSQL: transactions; MariaDB: SELECTs; not
//!   counted on SQLite).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use diesel::sql_types::BigInt;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError};
use tenure::{AnyConnection, Backend, TenureConnection};

use crate::drain::bench_worker;
use crate::options::Options;
use crate::support::{BenchDb, percentile};

const WAITERS: usize = 500;

/// Prints V1 to V3 for `backend`, one line each.
pub fn waiting(backend: Backend, options: &Options) {
    let db = BenchDb::new(backend);
    let pool = db.pool(options.workers as u32 + 6);
    let name = format!("{backend:?}");
    // V1: the worker is in this process.
    let returned_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let handler_done = returned_at.clone();
    let worker = bench_worker(pool.clone(), options)
        .raw_handler("noop", move |_: &JobContext, _: &[u8]| {
            *handler_done.lock().expect("lock") = Some(Instant::now());
            Ok::<(), JobError>(())
        })
        .start()
        .expect("start the worker");
    let job = NewJob::new("bench", "noop", vec![b'x'; options.payload]);
    let mut latencies = Vec::with_capacity(options.samples);
    for _ in 0..options.samples {
        let ended = jobs::enqueue_and_wait(&pool, &job, Duration::from_secs(30)).expect("wait");
        let now = Instant::now();
        assert!(ended.completed(), "{ended:?}");
        let done = returned_at
            .lock()
            .expect("lock")
            .take()
            .expect("the handler ran");
        latencies.push(now - done);
    }
    worker.shutdown(Duration::from_secs(10));
    print_row(
        &name,
        "V1. wait: job ended by a worker in the waiter's process",
        latencies,
    );

    // V2: completed by a statement on another connection, which wakes no waiter here.
    let mut conn = db.connect();
    let mut latencies = Vec::with_capacity(options.samples);
    for _ in 0..options.samples {
        let id = jobs::enqueue(&mut conn, &NewJob::new("elsewhere", "k", vec![]))
            .expect("enqueue")
            .id;
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let ended = jobs::wait(&pool, id, Duration::from_secs(30)).expect("wait");
                (ended, Instant::now())
            })
        };
        // Let the waiter register and sleep first.
        std::thread::sleep(Duration::from_millis(5 + rand_ms()));
        complete_behind_the_waiters_back(&mut conn, id);
        let committed = Instant::now();
        let (ended, returned) = waiter.join().expect("the waiter");
        assert!(ended.completed(), "{ended:?}");
        latencies.push(returned.saturating_duration_since(committed));
    }
    print_row(&name, "V2. wait: job ended by another process", latencies);

    // V3: idle waiters.
    let ids: Vec<i64> = (0..WAITERS)
        .map(|_| {
            jobs::enqueue(&mut conn, &NewJob::new("idle", "k", vec![]))
                .expect("enqueue")
                .id
        })
        .collect();
    let waiters: Vec<_> = ids
        .iter()
        .map(|&id| {
            let pool = pool.clone();
            std::thread::spawn(move || jobs::wait(&pool, id, Duration::from_secs(20)))
        })
        .collect();
    // Each waiter reads its job once as it starts (500 reads through a pool of a few
    // connections): let those pass, and PostgreSQL's statistics of them (a backend flushes
    // them up to 10 s later), before counting.
    std::thread::sleep(Duration::from_secs(11));
    let before = server_statements(&mut conn);
    let began = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    let after = server_statements(&mut conn);
    let per_s = match (before, after) {
        (Some(b), Some(a)) => format!("{:.0}", (a - b) as f64 / began.elapsed().as_secs_f64()),
        _ => "not counted".into(),
    };
    for waiter in waiters {
        assert!(matches!(
            waiter.join().expect("a waiter"),
            Err(tenure::Error::WaitTimedOut { .. })
        ));
    }
    println!("| {name} | V3. {WAITERS} idle waiters: server statements a second | {per_s} | | | |");
}

fn print_row(name: &str, label: &str, mut latencies: Vec<Duration>) {
    latencies.sort();
    let ms =
        |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3));
    println!(
        "| {name} | {label} (p50, p99 in the p95 column; max {}) | | {} | {} | |",
        ms(latencies.last().copied()),
        ms(percentile(&latencies, 0.5)),
        ms(percentile(&latencies, 0.99)),
    );
}

/// A few milliseconds, varied, so that completions fall anywhere in the waiters' poll cycle.
fn rand_ms() -> u64 {
    rand::random_range(0..25)
}

fn complete_behind_the_waiters_back(conn: &mut AnyConnection, id: i64) {
    use diesel::prelude::*;
    use tenure::schema::tenure_jobs;
    // The finish instant is only shown, never compared here: the client's clock will do.
    diesel::update(tenure_jobs::table.find(id))
        .set((
            tenure_jobs::state.eq(jobs::JobState::Completed),
            tenure_jobs::finished_at.eq(Some(chrono::Utc::now())),
        ))
        .execute(conn)
        .expect("complete by hand");
}

#[derive(diesel::QueryableByName)]
struct Counter {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// What the server counted for this database so far (see the module docs).
fn server_statements(conn: &mut AnyConnection) -> Option<i64> {
    let sql = match conn.backend() {
        Backend::Sqlite => return None,
        Backend::Postgres => {
            "SELECT CAST(xact_commit AS BIGINT) AS n FROM pg_stat_database \
             WHERE datname = current_database()"
        }
        Backend::Mysql => {
            "SELECT CAST(VARIABLE_VALUE AS SIGNED) AS n FROM information_schema.GLOBAL_STATUS \
             WHERE VARIABLE_NAME = 'COM_SELECT'"
        }
    };
    diesel::sql_query(sql)
        .get_result::<Counter>(conn)
        .ok()
        .map(|c| c.n)
}

//! C, C1, C2, R, R2, W1 and W2: draining waiting jobs with one worker, after a setup (an empty
//! table, a million finished jobs, 100,000 more waiting, rate-limited jobs, a workflow's
//! parts); the server's settling after a bulk setup; the harness's worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::enqueue::batch;
use crate::options::Options;
use crate::support::{BenchDb, Figures, resident_bytes, with_latencies};

/// Fills the table with `n` jobs of `queue` in bulk calls of at most 10,000.
fn fill(conn: &mut AnyConnection, options: &Options, queue: &str, n: usize) {
    let mut left = n;
    while left > 0 {
        let now = left.min(10_000);
        jobs::enqueue_many(conn, &batch(options, queue, now)).expect("fill");
        left -= now;
    }
}

/// Inserts `n` completed jobs (of another queue) as they would be after running: inserted
/// finished, not enqueued and then updated, so the setup leaves no million dead row
/// versions for the server to clean up during the drain.
fn fill_finished(conn: &mut AnyConnection, backend: Backend, n: usize) {
    let now = match backend {
        Backend::Postgres => "statement_timestamp()",
        Backend::Mysql => "UTC_TIMESTAMP(6)",
        _ => "strftime('%Y-%m-%d %H:%M:%f','now')",
    };
    let row = format!("('old', 'noop', 'x', 0, 'completed', 1, 25, {now}, {now}, {now})");
    let mut left = n;
    while left > 0 {
        let rows = left.min(1000);
        let values = vec![row.as_str(); rows].join(", ");
        conn.batch_execute(&format!(
            "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, \
             max_attempts, due_at, created_at, finished_at) VALUES {values}"
        ))
        .expect("insert finished jobs");
        left -= rows;
    }
}

/// C. Drain `options.jobs` waiting jobs with a worker of `options.workers` threads; before
/// that, `setup` may fill the table. Also samples the process's resident memory.
pub fn drain(backend: Backend, options: &Options, setup: Setup) -> (Figures, u64) {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let to_drain = options.jobs;
    match setup {
        Setup::Empty => {}
        Setup::Finished(n) => fill_finished(&mut conn, backend, n),
        Setup::Waiting(n) => fill(&mut conn, options, "bench", n),
        Setup::RateLimited(..) | Setup::Workflow(_) | Setup::Sequenced(_) | Setup::Fair(_) => {}
    }
    let mut to_drain = to_drain;
    if let Setup::Workflow(callbacks) = setup {
        // N parts, then one merge waiting for all of them (W1), or three batch callbacks
        // (W2): every completion counts down the waiting jobs' stripes.
        let mut flow = jobs::Workflow::new("bench");
        let parts: Vec<_> = batch(options, "bench", to_drain)
            .into_iter()
            .map(|job| flow.add(job))
            .collect();
        let merge = NewJob::new("bench", "noop", vec![]);
        if callbacks {
            flow.on_success(merge.clone())
                .on_failure(merge.clone())
                .on_finish(merge);
            to_drain += 2;
        } else {
            flow.add_after(&parts, merge);
            to_drain += 1;
        }
        jobs::enqueue_workflow(&mut conn, &flow).expect("fill");
    } else if let Setup::Sequenced(keys) = setup {
        for chunk in batch(options, "bench", to_drain).chunks(10_000) {
            let sequenced: Vec<NewJob> = chunk
                .iter()
                .enumerate()
                .map(|(i, job)| job.clone().sequence(format!("key-{}", i % keys)))
                .collect();
            jobs::enqueue_many(&mut conn, &sequenced).expect("fill");
        }
    } else if let Setup::Fair(tenants) = setup {
        for chunk in batch(options, "bench", to_drain).chunks(10_000) {
            let fair: Vec<NewJob> = chunk
                .iter()
                .enumerate()
                .map(|(i, job)| job.clone().fair_key(format!("tenant-{}", i % tenants)))
                .collect();
            jobs::enqueue_many(&mut conn, &fair).expect("fill");
        }
    } else if let Setup::RateLimited(max, per) = setup {
        for chunk in batch(options, "bench", to_drain).chunks(10_000) {
            let limited: Vec<NewJob> = chunk
                .iter()
                .map(|job| job.clone().rate_limit("bench", max, per))
                .collect();
            jobs::enqueue_many(&mut conn, &limited).expect("fill");
        }
    } else {
        fill(&mut conn, options, "bench", to_drain);
    }
    if !matches!(
        setup,
        Setup::Empty
            | Setup::RateLimited(..)
            | Setup::Workflow(_)
            | Setup::Sequenced(_)
            | Setup::Fair(_)
    ) {
        settle(backend, &mut conn);
    }
    let done = Arc::new(AtomicUsize::new(0));
    let pool = db.pool(options.workers as u32 + 4);
    let counter = done.clone();
    let events = Arc::new(AtomicUsize::new(0));
    let mut builder = bench_worker(pool, options).raw_handler(
        "noop",
        move |_ctx: &JobContext, _payload: &[u8]| {
            counter.fetch_add(1, Ordering::Relaxed);
            Ok::<(), JobError>(())
        },
    );
    if options.events {
        let events = events.clone();
        builder = builder.on_event(move |_| {
            events.fetch_add(1, Ordering::Relaxed);
        });
    }
    let started = Instant::now();
    let worker = builder.start().expect("start the worker");
    let mut rss = 0;
    while worker.report().completed < to_drain {
        rss = rss.max(resident_bytes("VmRSS"));
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = started.elapsed();
    worker.shutdown(Duration::from_secs(10));
    if options.events {
        assert!(
            events.load(Ordering::Relaxed) >= to_drain,
            "an event per run"
        );
    }
    let jobs_per_s = to_drain as f64 / took.as_secs_f64();
    (with_latencies(jobs_per_s, vec![]), rss)
}

/// After a bulk setup, lets the server catch up as it would have while those jobs piled up
/// over days: PostgreSQL's autovacuum (run now); InnoDB's purge of the old
/// row versions the setup's UPDATE left (waited for) and the writing of the pages it dirtied.
/// Otherwise the drain would measure the cleanup of the setup.
pub fn settle(backend: Backend, conn: &mut AnyConnection) {
    #[derive(diesel::QueryableByName)]
    struct Figure {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    use diesel::RunQueryDsl;
    let figure = |conn: &mut AnyConnection, sql: &str| {
        diesel::sql_query(sql)
            .get_result::<Figure>(conn)
            .map_or(0, |f| f.n)
    };
    match backend {
        // No CHECKPOINT: right after one, every page's first change writes a full page
        // image to the WAL, and the drain would pay for that instead.
        Backend::Postgres => conn
            .batch_execute("VACUUM ANALYZE tenure_jobs")
            .expect("vacuum"),
        Backend::Mysql => {
            conn.batch_execute("ANALYZE TABLE tenure_jobs")
                .expect("analyze");
            // The history list counts transactions, not rows: the setup's one big UPDATE is
            // one entry until its million row versions are purged.
            let until = Instant::now() + Duration::from_secs(120);
            while Instant::now() < until {
                let history = figure(
                    conn,
                    "SELECT CAST(`COUNT` AS SIGNED) AS n FROM information_schema.INNODB_METRICS \
                     WHERE NAME = 'trx_rseg_history_len'",
                );
                if history == 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            // Then write the pages the setup dirtied (what FOR EXPORT is for), instead of
            // during the drain.
            conn.batch_execute("FLUSH TABLES tenure_jobs FOR EXPORT")
                .expect("flush the table");
            conn.batch_execute("UNLOCK TABLES").expect("unlock");
        }
        _ => {}
    }
}

/// A worker on the bench queue with the harness's threads and prefetch.
pub fn bench_worker(pool: Pool, options: &Options) -> tenure::worker::WorkerBuilder {
    let builder = Worker::builder(pool)
        .queue("bench")
        .threads(options.workers);
    match options.prefetch {
        Some(prefetch) => builder.prefetch(prefetch),
        None => builder,
    }
}

#[derive(Clone, Copy)]
pub enum Setup {
    Empty,
    Finished(usize),
    Waiting(usize),
    /// Every job to drain carries this rate limit on one key, `(max, per)`: with 10,000 per
    /// millisecond it never throttles (what the rate bookkeeping costs a claim); with a
    /// lower rate, how close the worker comes to it.
    RateLimited(u32, Duration),
    /// The jobs are one workflow's parts: with one job waiting for all of them (false), or a
    /// batch with three callbacks (true).
    Workflow(bool),
    /// The jobs are spread over this many sequence keys, enqueued in turn.
    Sequenced(usize),
    /// The jobs are spread over this many fair keys (tenants), enqueued in turn.
    Fair(usize),
}

//! E: concurrent producers. 1, 4 and 16 threads, each on a connection of its own, each
//! enqueueing one job per transaction (`jobs::enqueue` on a bare connection: one
//! autocommit statement), while an idle worker listens (on PostgreSQL its LISTEN
//! connection receives every wake-up). Beside it, in the same run, the ceiling: the same
//! row inserted into `tenure_jobs` by a plain diesel statement, no tenure in between.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use diesel::sql_types::{Binary, Text};
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend};

use crate::support::{BenchDb, Figures, with_latencies};

/// Producer thread counts measured.
pub const PRODUCERS: [usize; 3] = [1, 4, 16];

/// How a producer inserts its jobs.
#[derive(Clone, Copy, PartialEq)]
pub enum Producer {
    Tenure,
    PlainInsert,
}

/// `jobs` jobs enqueued by `threads` producers (one job per transaction each); p50/p95 per
/// enqueue.
pub fn producers(backend: Backend, jobs: usize, threads: usize, how: Producer) -> Figures {
    let db = Arc::new(BenchDb::new(backend));
    let pool = db.pool(4);
    // Idle: its queue gets no jobs, but on PostgreSQL it LISTENs like any worker.
    let idle = Worker::builder(pool)
        .queue("elsewhere")
        .threads(1)
        .raw_handler("noop", |_: &JobContext, _: &[u8]| Ok::<(), JobError>(()))
        .start()
        .expect("start the idle worker");
    let per_thread = jobs / threads;
    let start = Arc::new(Barrier::new(threads + 1));
    let producers: Vec<_> = (0..threads)
        .map(|_| {
            let (db, start) = (db.clone(), start.clone());
            std::thread::spawn(move || {
                let mut conn = db.connect();
                let job = NewJob::new("bench", "noop", vec![b'x'; 16]);
                let mut latencies = Vec::with_capacity(per_thread);
                start.wait();
                for _ in 0..per_thread {
                    let t = Instant::now();
                    match how {
                        Producer::Tenure => {
                            jobs::enqueue(&mut conn, &job).expect("enqueue");
                        }
                        Producer::PlainInsert => plain_insert(&mut conn, backend),
                    }
                    latencies.push(t.elapsed());
                }
                latencies
            })
        })
        .collect();
    start.wait();
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(jobs);
    for producer in producers {
        latencies.extend(producer.join().expect("a producer panicked"));
    }
    let took = started.elapsed();
    idle.shutdown(Duration::from_secs(10));
    with_latencies(latencies.len() as f64 / took.as_secs_f64(), latencies)
}

/// The row `jobs::enqueue` writes for a plain job, by one diesel statement (the database's
/// clock for its times, as tenure's insert uses).
fn plain_insert(conn: &mut AnyConnection, backend: Backend) {
    let sql = match backend {
        Backend::Postgres => {
            "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, max_attempts, \
             due_at, created_at) VALUES ($1, $2, $3, 0, 'waiting', 25, \
             statement_timestamp(), statement_timestamp()) RETURNING id"
        }
        Backend::Mysql => {
            "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, max_attempts, \
             due_at, created_at) VALUES (?, ?, ?, 0, 'waiting', 25, \
             UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
        }
        Backend::Sqlite => {
            "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, max_attempts, \
             due_at, created_at) VALUES (?, ?, ?, 0, 'waiting', 25, \
             strftime('%Y-%m-%d %H:%M:%f','now'), strftime('%Y-%m-%d %H:%M:%f','now')) \
             RETURNING id"
        }
    };
    let insert = diesel::sql_query(sql)
        .bind::<Text, _>("bench")
        .bind::<Text, _>("noop")
        .bind::<Binary, _>(vec![b'x'; 16]);
    match conn {
        #[cfg(feature = "postgres")]
        AnyConnection::Postgres(c) => insert.execute(c),
        #[cfg(feature = "mysql")]
        AnyConnection::Mysql(c) => insert.execute(c),
        #[cfg(feature = "sqlite")]
        AnyConnection::Sqlite(c) => insert.execute(c),
    }
    .expect("plain insert");
}

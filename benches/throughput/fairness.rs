//! X1: fair claiming. Tenant A's 50,000 jobs wait; then nine tenants enqueue 10 jobs each
//! (after A's), and a worker (`options.workers` threads) starts. Printed: the rate the worker
//! ran at until the last late job started, and the late jobs' waits from their enqueue to
//! their claim (database clock), with fair keys and without (the control: they wait for A's
//! backlog).

use std::time::{Duration, Instant};

use diesel::RunQueryDsl;

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, JobError};

use crate::drain::bench_worker;
use crate::options::Options;
use crate::support::{BenchDb, Figures, with_latencies};

const BACKLOG: usize = 50_000;
const TENANTS: usize = 9;
const PER_TENANT: usize = 10;

/// One run: the figures (jobs/s until the last late job ran; p50 and p95 of the late jobs'
/// waits), the longest wait, and how many of the backlog's jobs started before the last late
/// job did (by the database's clock): the bound, in jobs.
pub fn late_tenants(backend: Backend, options: &Options, fair: bool) -> (Figures, Duration, usize) {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let job = |tenant: &str| {
        let job = NewJob::new("bench", "noop", vec![b'x'; options.payload]);
        if fair { job.fair_key(tenant) } else { job }
    };
    let backlog: Vec<NewJob> = (0..BACKLOG).map(|_| job("a")).collect();
    for chunk in backlog.chunks(10_000) {
        jobs::enqueue_many(&mut conn, chunk).expect("fill the backlog");
    }
    let mut late = Vec::new();
    for t in 0..TENANTS {
        for _ in 0..PER_TENANT {
            let id = jobs::enqueue(&mut conn, &job(&format!("t{t}")))
                .expect("enqueue a late job")
                .id;
            late.push(id);
        }
    }
    let pool = db.pool(options.workers as u32 + 4);
    let worker = bench_worker(pool, options)
        .raw_handler("noop", |_: &JobContext, _: &[u8]| Ok::<(), JobError>(()))
        .start()
        .expect("start the worker");
    let started = Instant::now();
    let mut waits = Vec::new();
    let deadline = started + Duration::from_secs(600);
    while Instant::now() < deadline {
        waits.clear();
        for &id in &late {
            let job = jobs::get(&mut conn, id)
                .expect("read a late job")
                .expect("a late job");
            if let (JobState::Completed, Some(claimed_at)) = (job.state, job.claimed_at) {
                waits.push((claimed_at - job.created_at).to_std().unwrap_or_default());
            }
        }
        if waits.len() == late.len() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let ran = worker.report().completed;
    worker.shutdown(Duration::from_secs(10));
    let longest = waits.iter().max().copied().unwrap_or_default();
    // The backlog's jobs that started before the last late job did, by the database's clock
    // (the late jobs have the greatest ids).
    let first_late = late.iter().min().copied().unwrap_or_default();
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let ahead = diesel::sql_query(format!(
        "SELECT COUNT(*) AS n FROM tenure_jobs a WHERE a.id < {first_late} AND a.claimed_at <= \
         (SELECT MAX(l.claimed_at) FROM tenure_jobs l WHERE l.id >= {first_late})"
    ))
    .get_result::<N>(&mut conn)
    .map(|row| row.n as usize)
    .expect("count the backlog's jobs that started first");
    (with_latencies(ran as f64 / elapsed, waits), longest, ahead)
}

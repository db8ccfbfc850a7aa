//! Sequences across processes: 8 claimers over 3 worker processes, one SIGKILLed about
//! every 1.5 s and replaced, runs failing at random: per key, runs never overlap and start
//! in enqueue order (by the database's clock and by ids).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Pool};

use crate::child::{Spawned, report, spawn, sql};
use crate::common::{TestDb, conformance, count};
use crate::processes::exec;

conformance!(a_sequence_keeps_its_order_through_sigkilled_workers,);

const KEYS: usize = 10;
const PER_KEY: usize = 30;

fn start_worker(url: &str, threads: usize) -> Spawned {
    let mut worker = spawn("sequence-worker", &[url, &threads.to_string()]);
    assert_eq!(worker.next_report().as_deref(), Some("started"));
    worker
}

/// 300 jobs on 10 keys; a fifth of them fail their first run. Every job completes; per key,
/// the runs sorted by their start (database clock) have ascending job ids (a retry repeats
/// its id), and each run starts after the previous one of its key ended (a run killed
/// mid-way has no end: its process is gone before the rescue hands its job out again).
fn a_sequence_keeps_its_order_through_sigkilled_workers(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    exec(
        &mut conn,
        "CREATE TABLE fault_runs (job_id BIGINT NOT NULL, seq_key VARCHAR(16) NOT NULL, \
         started_us BIGINT NOT NULL, ended_us BIGINT NULL, pid BIGINT NOT NULL)",
    );
    // Interleaved keys: one bulk call, each key's order the batch's.
    let batch: Vec<NewJob> = (0..KEYS * PER_KEY)
        .map(|i| {
            let key = format!("k{}", i % KEYS);
            NewJob::new("seqchaos", "run", key.clone().into_bytes()).sequence(key)
        })
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let threads = [3, 3, 2];
    let mut workers: Vec<(Spawned, usize)> = threads
        .iter()
        .map(|t| (start_worker(db.url(), *t), *t))
        .collect();
    let stall = Duration::from_secs(90);
    let (mut fewest, mut progressed) = (i64::MAX, Instant::now());
    let mut next_kill = Instant::now() + Duration::from_millis(1200);
    let mut kills = 0;
    loop {
        let left = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'",
        );
        if left == 0 {
            break;
        }
        if left < fewest {
            (fewest, progressed) = (left, Instant::now());
        }
        assert!(
            progressed.elapsed() < stall,
            "{left} jobs left, none completed for {stall:?}"
        );
        if Instant::now() >= next_kill && left > 30 {
            let victim = rand::random_range(0..workers.len());
            let (mut dead, threads) = workers.swap_remove(victim);
            let _ = dead.child.kill(); // SIGKILL
            let _ = dead.child.wait();
            kills += 1;
            workers.push((start_worker(db.url(), threads), threads));
            next_kill = Instant::now() + Duration::from_millis(rand::random_range(1000..2000));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(workers);
    assert!(
        kills > 0,
        "no worker was killed: the scenario showed nothing"
    );

    #[derive(QueryableByName)]
    struct Run {
        #[diesel(sql_type = BigInt)]
        job_id: i64,
        #[diesel(sql_type = Text)]
        seq_key: String,
        #[diesel(sql_type = BigInt)]
        started_us: i64,
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        ended_us: Option<i64>,
    }
    let runs = diesel::sql_query(
        "SELECT job_id, seq_key, started_us, ended_us FROM fault_runs ORDER BY started_us, job_id",
    )
    .load::<Run>(&mut conn)
    .unwrap();
    let mut by_key: HashMap<&str, Vec<&Run>> = HashMap::new();
    for run in &runs {
        by_key.entry(&run.seq_key).or_default().push(run);
    }
    assert_eq!(by_key.len(), KEYS);
    let mut problems = Vec::new();
    for (key, runs) in &by_key {
        for pair in runs.windows(2) {
            let (before, after) = (pair[0], pair[1]);
            if after.job_id < before.job_id {
                problems.push(format!(
                    "{key}: job {} started after job {}, which was enqueued after it",
                    after.job_id, before.job_id
                ));
            }
            if let Some(ended) = before.ended_us
                && after.started_us < ended
            {
                problems.push(format!(
                    "{key}: job {}'s run started {} us before job {}'s run ended",
                    after.job_id,
                    ended - after.started_us,
                    before.job_id
                ));
            }
        }
        let ids: std::collections::HashSet<i64> = runs.iter().map(|r| r.job_id).collect();
        if ids.len() != PER_KEY {
            problems.push(format!("{key}: {} jobs ran, not {PER_KEY}", ids.len()));
        }
    }
    assert!(problems.is_empty(), "{kills} kills; {problems:#?}");
}

/// A worker process of the sequences scenario: `threads` threads on queue "seqchaos"; each
/// run records its start and, unless it fails (a fifth of the jobs, on their first run),
/// its end, both by the database's clock. Runs until killed.
pub(crate) fn sequence_worker(url: &str, threads: usize) {
    let pool = Pool::options()
        .max_size(threads as u32 + 6)
        .open(url)
        .expect("pool");
    let runs = pool.clone();
    let pid = std::process::id() as i64;
    let worker = Worker::builder(pool)
        .queue("seqchaos")
        .threads(threads)
        .prefetch(0)
        .claim_ttl(Duration::from_secs(10))
        .poll_interval(Duration::from_millis(50))
        .raw_handler("run", move |ctx: &JobContext, key: &[u8]| {
            let key = String::from_utf8_lossy(key).into_owned();
            let backend = runs.backend();
            let mut conn = runs.get()?;
            let micros = |conn: &mut tenure::PooledConnection| -> Result<i64, tenure::Error> {
                Ok(tenure::database_now(&mut **conn)?.timestamp_micros())
            };
            let started = micros(&mut conn)?;
            diesel::sql_query(sql(
                backend,
                "INSERT INTO fault_runs (job_id, seq_key, started_us, ended_us, pid) \
                 VALUES (?, ?, ?, NULL, ?)",
            ))
            .bind::<BigInt, _>(ctx.id)
            .bind::<Text, _>(&key)
            .bind::<BigInt, _>(started)
            .bind::<BigInt, _>(pid)
            .execute(&mut *conn)
            .map_err(tenure::Error::from)?;
            std::thread::sleep(Duration::from_millis(5 + (ctx.id as u64 * 7919) % 20));
            if ctx.attempt == 1 && ctx.id % 5 == 0 {
                return Err(JobError::retry("the first run of every fifth job fails"));
            }
            let ended = micros(&mut conn)?;
            diesel::sql_query(sql(
                backend,
                "UPDATE fault_runs SET ended_us = ? WHERE job_id = ? AND started_us = ? AND pid = ?",
            ))
            .bind::<BigInt, _>(ended)
            .bind::<BigInt, _>(ctx.id)
            .bind::<BigInt, _>(started)
            .bind::<BigInt, _>(pid)
            .execute(&mut *conn)
            .map_err(tenure::Error::from)?;
            Ok(())
        })
        .start()
        .expect("start the worker");
    report("started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let _ = worker.report();
    }
}

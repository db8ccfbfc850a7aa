//! A resumable batch: a handler made of durable steps (fetch, transform, upload, notify)
//! whose first run crashes after "transform"; the retry resumes after the last completed
//! step, and each step's database write lands once.
//!
//! ```text
//! cargo run --example resumable_batch                 # an in-memory SQLite database
//! cargo run --example resumable_batch -- postgres://root@127.0.0.1/test --features postgres
//! ```
//!
//! Each step runs in a transaction with its result: what a step writes to the database
//! commits with the step's stored result, or not at all. A retry reads the stored results
//! instead of running those steps again.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use tenure::diesel::{self, RunQueryDsl};
use tenure::jobs::{self, Backoff, JobArgs};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, TenureConnection};

#[derive(serde::Serialize, serde::Deserialize)]
struct Batch {
    name: String,
}

impl JobArgs for Batch {
    const KIND: &'static str = "batch";
    const QUEUE: &'static str = "batches";
}

/// How many times each step's closure ran (to show the retry skipped the completed ones).
static RUNS: [AtomicU32; 4] = [const { AtomicU32::new(0) }; 4];

/// Records in `batch_log` that a step of job `id` did its work.
fn log(conn: &mut AnyConnection, id: i64, step: &str) -> diesel::QueryResult<usize> {
    let sql = match conn.backend() {
        tenure::Backend::Postgres => "INSERT INTO batch_log (job_id, step) VALUES ($1, $2)",
        _ => "INSERT INTO batch_log (job_id, step) VALUES (?, ?)",
    };
    diesel::sql_query(sql)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(step)
        .execute(conn)
}

fn run_batch(ctx: &JobContext, batch: Batch) -> Result<(), JobError> {
    println!("run {} of {}", ctx.attempt, batch.name);
    let rows: Vec<i64> = ctx.step("fetch", |conn| {
        RUNS[0].fetch_add(1, Ordering::SeqCst);
        log(conn, ctx.id, "fetch")?;
        println!("  fetch: fetched 5 rows");
        Ok::<_, JobError>(vec![3, 1, 4, 1, 5])
    })?;
    let total: i64 = ctx.step("transform", |conn| {
        RUNS[1].fetch_add(1, Ordering::SeqCst);
        log(conn, ctx.id, "transform")?;
        println!("  transform: summed the rows");
        Ok::<_, JobError>(rows.iter().sum())
    })?;
    if ctx.attempt == 1 {
        // A crash here (a panic, a kill, a lost connection): the run fails, the job is
        // retried, and its completed steps stay done.
        println!("  (the first run crashes after transform)");
        panic!("simulated crash");
    }
    let url: String = ctx.step("upload", |conn| {
        RUNS[2].fetch_add(1, Ordering::SeqCst);
        log(conn, ctx.id, "upload")?;
        println!("  upload: uploaded the total {total}");
        Ok::<_, JobError>(format!("s3://reports/{}-{total}.json", batch.name))
    })?;
    ctx.step("notify", |conn| {
        RUNS[3].fetch_add(1, Ordering::SeqCst);
        log(conn, ctx.id, "notify")?;
        println!("  notify: told the team about {url}");
        Ok::<_, JobError>(())
    })?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| ":memory:".to_string());
    // One connection: an in-memory SQLite database is one connection's (a drain holds none
    // while a handler runs, so the steps get it).
    let pool = tenure::Pool::options().max_size(1).open(&url)?;
    tenure::run_migrations(&mut pool.get()?)?;
    diesel::sql_query("DROP TABLE IF EXISTS batch_log").execute(&mut pool.get()?)?;
    diesel::sql_query("CREATE TABLE batch_log (job_id BIGINT NOT NULL, step VARCHAR(20) NOT NULL)")
        .execute(&mut pool.get()?)?;
    let id = jobs::enqueue_job(
        &mut pool.get()?,
        &Batch {
            name: "nightly".into(),
        },
    )?
    .id;
    // The panic's message is the crash being simulated; keep it off the output.
    std::panic::set_hook(Box::new(|_| {}));

    let report = Worker::builder(pool.clone())
        .register(run_batch)
        // The retry due at once, so that this drain runs it.
        .backoff(Backoff {
            base: Duration::ZERO,
            max: Duration::ZERO,
        })
        .drain()?;
    let _ = std::panic::take_hook();

    let mut conn = pool.get()?;
    let steps = jobs::steps(&mut conn, id)?;
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    let runs: Vec<u32> = RUNS.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let logged = diesel::sql_query("SELECT COUNT(*) AS n FROM batch_log")
        .get_result::<N>(&mut *conn)?
        .n;
    println!(
        "{} completed, {} retried; steps stored: {names:?}; runs per step: {runs:?}; rows logged: {logged}",
        report.completed, report.retried
    );
    if report.completed != 1 || runs != [1, 1, 1, 1] || logged != 4 {
        return Err("a step ran more than once".into());
    }
    Ok(())
}

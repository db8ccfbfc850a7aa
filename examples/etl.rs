//! A small ETL as a workflow: fetch N parts in parallel, then merge them, then report.
//!
//! ```text
//! cargo run --example etl                 # 8 parts, SQLite file etl.db here
//! cargo run --example etl -- 20 URL       # 20 parts, any database
//! ```
//!
//! Each `fetch` job returns its part as a result; `merge` depends on every fetch, runs once
//! they all completed, and reads their results; `report` is the workflow's success
//! callback. Part 3 fails on its first attempt (a flaky source) and is retried: `merge`
//! waits for it. While `merge` runs it reports progress, which the main thread prints.

use std::process::ExitCode;
use std::time::Duration;

use tenure::Pool;
use tenure::jobs::{self, Backoff, JobResult, JobState, NewJob, Workflow};
use tenure::worker::{JobContext, JobError, Worker};

#[derive(serde::Serialize, serde::Deserialize)]
struct Part {
    index: u32,
    rows: Vec<u64>,
}

/// A part from a source that fails once for part 3.
fn fetch(ctx: &JobContext, index: u32) -> Result<(), JobError> {
    if index == 3 && ctx.attempt == 1 {
        return Err(JobError::retry("source timed out"));
    }
    let rows = (0..100).map(|i| u64::from(index) * 1000 + i).collect();
    ctx.set_result(JobResult::json(&Part { index, rows })?);
    Ok(())
}

/// Sums every part's rows, reporting progress as it goes.
fn merge(ctx: &JobContext, _: &[u8]) -> Result<(), JobError> {
    let parts = ctx.dependency_results()?;
    let mut total = 0u64;
    for (i, part) in parts.iter().enumerate() {
        let part: Part = part
            .result
            .as_ref()
            .ok_or("a part has no result")?
            .decode()?;
        total += part.rows.iter().sum::<u64>();
        ctx.set_progress(
            (i + 1) as f64 / parts.len() as f64,
            &format!("part {}", part.index),
        );
        std::thread::sleep(Duration::from_millis(150)); // the real work
    }
    ctx.set_result(JobResult::json(&total)?);
    Ok(())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parts: u32 = args.first().map(|n| n.parse()).transpose()?.unwrap_or(8);
    let url = args.get(1).map_or("etl.db", String::as_str);
    let pool = Pool::open(url)?;
    tenure::run_migrations(&mut pool.get()?)?;

    let mut etl = Workflow::new("nightly-etl");
    let fetches: Vec<_> = (0..parts)
        .map(|i| Ok(etl.add(NewJob::json("etl", "fetch", &i)?)))
        .collect::<Result<_, tenure::Error>>()?;
    etl.add_after(&fetches, NewJob::new("etl", "merge", vec![]));
    etl.on_success(NewJob::new("etl", "report", vec![]));
    let made = jobs::enqueue_workflow(&mut pool.get()?, &etl)?;
    let merge_id = made.jobs[parts as usize];

    let worker = Worker::builder(pool.clone())
        .queue("etl")
        .threads(4)
        .backoff(Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_millis(100),
        })
        .handler("fetch", fetch)
        .raw_handler("merge", merge)
        .raw_handler("report", |_: &JobContext, _: &[u8]| Ok::<(), JobError>(()))
        .start()?;
    let mut conn = pool.get()?;
    loop {
        let status = jobs::workflow_status(&mut conn, made.id)?.ok_or("no workflow")?;
        let merge = jobs::get(&mut conn, merge_id)?.ok_or("no merge job")?;
        println!(
            "fetched {}/{parts}; merge {} {}",
            status.counts.completed.min(i64::from(parts)),
            merge.state.as_str(),
            merge
                .progress
                .map_or(String::new(), |p| format!("{:.0}%", p * 100.0)),
        );
        if status
            .on_success
            .is_some_and(|(_, state)| state == JobState::Completed)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    worker.shutdown(Duration::from_secs(5));
    let total: u64 = jobs::result(&mut conn, merge_id)?
        .ok_or("no total")?
        .decode()?;
    let expected: u64 = (0..u64::from(parts))
        .map(|i| (0..100).map(|r| i * 1000 + r).sum::<u64>())
        .sum();
    println!("merged {parts} parts: total {total}");
    if total != expected {
        return Err(format!("expected {expected}").into());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("etl: {e}");
            ExitCode::FAILURE
        }
    }
}

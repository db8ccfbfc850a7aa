//! Workflows run by workers: results handlers set are kept with their completions and read
//! by dependents, and progress reported in a tight loop is visible while the job runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant as Clock};

use tenure::Backend;
use tenure::jobs::{self, JobResult, JobState, NewJob, Workflow};
use tenure::worker::{JobContext, JobError, Worker};

use crate::common::{TestDb, conformance};

conformance!(
    an_etl_workflow_run_by_a_worker_merges_its_parts_results,
    progress_reported_in_a_tight_loop_is_visible_while_the_job_runs,
);

/// The README's ETL: fetch 20 parts (each handler sets its progress and result and
/// returns at once: the last progress is written with the completion), then merge (its
/// handler reads the parts' results through its context and sets the total), then a
/// success callback; a 4-thread worker runs it all.
fn an_etl_workflow_run_by_a_worker_merges_its_parts_results(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = db.connect();
    let mut etl = Workflow::new("etl");
    let parts: Vec<_> = (1..=20u64)
        .map(|i| etl.add(NewJob::json("etl", "fetch", &i).unwrap()))
        .collect();
    let merge = etl.add_after(&parts, NewJob::new("etl", "merge", vec![]));
    let _ = merge;
    etl.on_success(NewJob::new("etl", "done", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &etl).unwrap();
    let merge_id = made.jobs[20];
    let done = Arc::new(AtomicBool::new(false));
    let done_seen = done.clone();
    let worker = Worker::builder(pool)
        .queue("etl")
        .threads(4)
        .handler(
            "fetch",
            |ctx: &JobContext, part: u64| -> Result<(), JobError> {
                ctx.set_progress(0.5, "half");
                ctx.set_progress(1.0, "fetched");
                ctx.set_result(JobResult::json(&(part * 10))?);
                Ok(())
            },
        )
        .raw_handler(
            "merge",
            |ctx: &JobContext, _: &[u8]| -> Result<(), JobError> {
                let parts = ctx.dependency_results()?;
                let mut total = 0u64;
                for part in &parts {
                    let result = part.result.as_ref().ok_or("a part without a result")?;
                    total += result.decode::<u64>()?;
                }
                ctx.set_result(JobResult::json(&total)?);
                Ok(())
            },
        )
        .raw_handler(
            "done",
            move |_: &JobContext, _: &[u8]| -> Result<(), JobError> {
                done_seen.store(true, Ordering::SeqCst);
                Ok(())
            },
        )
        .start()
        .unwrap();
    let started = Clock::now();
    while !done.load(Ordering::SeqCst) {
        assert!(
            started.elapsed() < Duration::from_secs(50),
            "the workflow did not finish"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let report = worker.shutdown(Duration::from_secs(10));
    assert_eq!(report.completed, 22, "{report:?}");
    let total = jobs::result(&mut conn, merge_id).unwrap().unwrap();
    assert_eq!(total.decode::<u64>().unwrap(), (1..=20).sum::<u64>() * 10);
    let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
    assert_eq!(status.counts.completed, 21);
    // The last progress a run set is kept with its completion (not lost with the run).
    for part in &made.jobs[..20] {
        assert_eq!(
            jobs::progress(&mut conn, *part).unwrap(),
            Some((1.0, "fetched".to_string()))
        );
    }
    assert_eq!(status.on_success.unwrap().1, JobState::Completed);
}

/// A handler reports progress a million times in a loop, then waits (up to 50 s) for the
/// test to see it: another connection reads the latest value while the job is still
/// running (the worker writes it at most once a second).
fn progress_reported_in_a_tight_loop_is_visible_while_the_job_runs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("p", "long", vec![]))
        .unwrap()
        .id;
    let seen = Arc::new(AtomicBool::new(false));
    let seen_by_handler = seen.clone();
    let worker = Worker::builder(pool)
        .queue("p")
        .threads(2)
        .raw_handler(
            "long",
            move |ctx: &JobContext, _: &[u8]| -> Result<(), JobError> {
                for i in 0..1_000_000u32 {
                    ctx.set_progress(f64::from(i + 1) / 1e6, "rows");
                }
                let started = Clock::now();
                while !seen_by_handler.load(Ordering::SeqCst)
                    && started.elapsed() < Duration::from_secs(50)
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(())
            },
        )
        .start()
        .unwrap();
    let started = Clock::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(45),
            "progress never appeared"
        );
        let job = jobs::get(&mut conn, id).unwrap().unwrap();
        if job.progress == Some(1.0) {
            assert_eq!(job.state, JobState::Running);
            assert_eq!(job.progress_message.as_deref(), Some("rows"));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    seen.store(true, Ordering::SeqCst);
    let report = worker.shutdown(Duration::from_secs(10));
    assert_eq!(report.completed, 1);
}

//! `dibs demo`: a realistic batch, a worker pool, a live progress bar, and a summary.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use dibs::jobs::{self, Backoff, Finished, NewJob, Retention};
use dibs::lease::Wait;
use dibs::schedules::{self, Schedule};
use dibs::worker::{JobContext, JobError, Worker};
use dibs::{LeaseGuard, Pool};

use crate::{Failure, Outcome};

#[derive(Args)]
pub struct DemoArgs {
    /// How many jobs to enqueue.
    #[arg(long, default_value_t = 5000)]
    jobs: usize,
    /// Worker threads.
    #[arg(long, default_value_t = 8)]
    threads: usize,
}

const QUEUE: &str = "demo";
const SYNC_LEASE: &str = "demo-sync-account-42";

pub fn run(args: DemoArgs, url: Option<String>) -> Outcome {
    if args.jobs < 100 {
        return Err(Failure::new(2, "the demo needs at least 100 jobs"));
    }
    let url = match url {
        Some(url) => url,
        None => {
            // The demo's own file, fresh each time.
            for file in ["dibs-demo.db", "dibs-demo.db-wal", "dibs-demo.db-shm"] {
                let _ = std::fs::remove_file(file);
            }
            "dibs-demo.db".to_string()
        }
    };
    let pool = Pool::options()
        .max_size(args.threads as u32 + 6)
        .open(&url)?;
    let mut conn = pool.get()?;
    dibs::run_migrations(&mut conn)?;
    // Leftovers of an earlier demo on this database.
    for finished in [Finished::Completed, Finished::Dead, Finished::Cancelled] {
        while jobs::prune(
            &mut conn,
            QUEUE,
            finished,
            Retention::DeleteAll,
            jobs::MAX_BATCH,
        )? == jobs::MAX_BATCH
        {}
    }
    let leftovers = jobs::list(
        &mut conn,
        &jobs::JobFilter {
            queue: Some(QUEUE.into()),
            limit: jobs::MAX_BATCH,
            ..Default::default()
        },
    )?;
    for job in leftovers {
        jobs::cancel(&mut conn, job.id)?;
    }
    while jobs::prune(
        &mut conn,
        QUEUE,
        Finished::Cancelled,
        Retention::DeleteAll,
        jobs::MAX_BATCH,
    )? == jobs::MAX_BATCH
    {}
    schedules::remove(&mut conn, "demo-heartbeat")?;

    // The batch: thumbnails (quick), emails (a tenth fail once and retry; a few never
    // succeed and end dead), reports (delayed 1-3 s), and account syncs that must run one at
    // a time (a lease).
    let n = args.jobs;
    let (emails, reports, syncs) = (n / 5, n / 20, 40.min(n / 10));
    let thumbnails = n - emails - reports - syncs;
    let mut batch = Vec::with_capacity(n);
    batch.extend(
        (0..thumbnails).map(|i| NewJob::new(QUEUE, "thumbnail", i.to_string().into_bytes())),
    );
    batch.extend(
        (0..emails)
            .map(|i| NewJob::new(QUEUE, "email", i.to_string().into_bytes()).max_attempts(3)),
    );
    batch.extend((0..reports).map(|i| {
        NewJob::new(QUEUE, "report", i.to_string().into_bytes())
            .delay(Duration::from_millis(1000 + (i as u64 * 37) % 2000))
    }));
    batch.extend((0..syncs).map(|i| NewJob::new(QUEUE, "sync", i.to_string().into_bytes())));
    let enqueue_started = Instant::now();
    jobs::enqueue_many(&mut conn, &batch)?;
    let enqueue_took = enqueue_started.elapsed();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "demo-heartbeat",
            Duration::from_secs(1),
            NewJob::new(QUEUE, "tick", vec![]),
        ),
    )?;
    drop(conn);
    println!(
        "dibs demo on {}: enqueued {n} jobs in {:.0} ms ({thumbnails} thumbnails, {emails} emails, {reports} delayed reports, {syncs} account syncs) and a schedule ticking every second",
        pool.backend(),
        enqueue_took.as_secs_f64() * 1000.0
    );

    let syncing = Arc::new(AtomicUsize::new(0));
    let most_syncing = Arc::new(AtomicUsize::new(0));
    let fences = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sync_pool = pool.clone();
    let ticks = Arc::new(AtomicUsize::new(0));
    let tick_count = ticks.clone();
    let (now, most, fence_log) = (syncing.clone(), most_syncing.clone(), fences.clone());
    let worker = Worker::builder(pool.clone())
        .queue(QUEUE)
        .threads(args.threads)
        .run_schedules()
        .poll_interval(Duration::from_millis(100))
        .raw_handler("thumbnail", |_: &JobContext, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(1));
            Ok(())
        })
        .raw_handler("email", |ctx: &JobContext, payload: &[u8]| {
            let i: usize = std::str::from_utf8(payload)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis(2));
            if i % 97 == 0 {
                return Err(JobError::retry("mailbox does not exist"));
            }
            if i % 10 == 0 && ctx.attempt == 1 {
                return Err(JobError::retry("SMTP server busy, try later"));
            }
            Ok(())
        })
        .kind_backoff(
            "email",
            Backoff {
                base: Duration::from_millis(200),
                max: Duration::from_secs(2),
            },
        )
        .raw_handler("report", |_: &JobContext, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(5));
            Ok(())
        })
        .raw_handler("sync", move |_: &JobContext, _: &[u8]| {
            // One account, one sync at a time, across threads, processes and hosts.
            let guard = LeaseGuard::take_pooled(
                &sync_pool,
                SYNC_LEASE,
                Duration::from_secs(10),
                "demo",
                Wait::up_to(Duration::from_secs(60)).poll_interval(Duration::from_millis(5)),
            )?
            .ok_or_else(|| JobError::retry("the account is busy"))?;
            let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(at_once, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(10));
            now.fetch_sub(1, Ordering::SeqCst);
            fence_log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(guard.fence());
            guard.release()?;
            Ok(())
        })
        .raw_handler("tick", move |_: &JobContext, _: &[u8]| {
            tick_count.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .start()?;

    let started = Instant::now();
    let expected_dead = (0..emails).filter(|i| i % 97 == 0).count();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let report = worker.report();
        let finished =
            (report.completed + report.dead).saturating_sub(ticks.load(Ordering::SeqCst));
        let width = 30;
        let filled = (finished.min(n) * width) / n;
        let rate = finished as f64 / started.elapsed().as_secs_f64();
        let line = format!(
            "\r[{}{}] {:>6}/{n} jobs  {:>7.0} jobs/s  retried {:<4} dead {:<3}",
            "#".repeat(filled),
            ".".repeat(width - filled),
            finished.min(n),
            rate,
            report.retried,
            report.dead
        );
        print!("{line}");
        let _ = std::io::stdout().flush();
        let waiting = jobs::stats(&mut pool.get()?)?
            .queues
            .iter()
            .find(|q| q.queue == QUEUE)
            .map_or(0, |q| q.waiting + q.running);
        if finished >= n && waiting == 0 && report.dead >= expected_dead {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(Failure::new(1, "the demo did not finish within 10 minutes"));
        }
    }
    let took = started.elapsed();
    let report = worker.shutdown(Duration::from_secs(5));
    println!();
    let fences = fences.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let ticks = ticks.load(Ordering::SeqCst);
    let completed = report.completed - ticks;
    println!();
    println!(
        "{}",
        crate::output::table(
            &["", ""],
            [
                (
                    "processed",
                    format!(
                        "{} runs of {n} jobs: {completed} completed, {} dead",
                        completed + report.dead + report.retried,
                        report.dead
                    )
                ),
                (
                    "retried",
                    format!("{} runs failed and were retried", report.retried)
                ),
                (
                    "dead",
                    format!("{} jobs failed for good after 3 attempts", report.dead)
                ),
                (
                    "throughput",
                    format!(
                        "{:.0} jobs/s over {:.1} s with {} threads",
                        (completed + report.dead) as f64 / took.as_secs_f64(),
                        took.as_secs_f64(),
                        args.threads
                    )
                ),
                (
                    "schedule",
                    format!("{ticks} heartbeat ticks fired, each once")
                ),
                (
                    "lease",
                    format!(
                        "{SYNC_LEASE}: {} syncs, at most {} at a time, fences {}..{}",
                        fences.len(),
                        most_syncing.load(Ordering::SeqCst),
                        fences.iter().min().copied().unwrap_or(0),
                        fences.iter().max().copied().unwrap_or(0)
                    )
                ),
            ]
            .into_iter()
            .map(|(k, v)| vec![k.to_string(), v]),
        )
        .lines()
        .skip(1)
        .collect::<Vec<_>>()
        .join("\n")
    );
    if most_syncing.load(Ordering::SeqCst) > 1 {
        return Err(Failure::new(1, "two syncs ran at once: the lease failed"));
    }
    Ok(())
}

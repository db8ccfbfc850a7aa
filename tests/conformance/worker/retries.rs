//! A worker's retries: a retry instant the database refuses falls back to the kind's backoff and
//! blocks no other job, and retries due at once on two workers run each attempt once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use tenure::Backend;
use tenure::jobs::{self, Backoff, JobState, NewJob};
use tenure::worker::{JobContext, JobError, Worker};

use crate::common::{TestDb, conformance, count, wait_for};

conformance!(
    a_refused_retry_instant_falls_back_to_the_kinds_backoff,
    a_refused_retry_instant_does_not_block_other_jobs,
    two_workers_with_retries_due_at_once_run_each_attempt_once,
);

/// Odd retry instants (before 4713 BC, which PostgreSQL refuses; years 0..999 and past 9999,
/// outside MariaDB's DATETIME; signed years in SQLite's text layout). Each must be recorded
/// as asked (an instant in the past is due at once) or, when refused, with the kind's backoff
/// (the job waits about an hour, one attempt used). Never by giving the record up so the
/// claim lapses (the job reruns at once, burns lapses, dies of them), and a future instant
/// must never make the job due at once.
fn a_refused_retry_instant_falls_back_to_the_kinds_backoff(backend: Backend) {
    let instants: Vec<(&str, DateTime<Utc>)> = vec![
        ("min", DateTime::<Utc>::MIN_UTC),
        ("bc", Utc.with_ymd_and_hms(-5000, 1, 1, 0, 0, 0).unwrap()),
        ("y0", Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap()),
        ("y999", Utc.with_ymd_and_hms(999, 1, 1, 0, 0, 0).unwrap()),
        (
            "y10000",
            Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap(),
        ),
        ("max", DateTime::<Utc>::MAX_UTC),
    ];
    let hour = Backoff {
        base: Duration::from_secs(3600),
        max: Duration::from_secs(3600),
    };
    let mut failures = Vec::new();
    for (name, at) in instants {
        let db = TestDb::migrated(backend);
        let mut conn = db.connect();
        let id = jobs::enqueue(&mut conn, &NewJob::new("at", "k", vec![]).max_attempts(5))
            .unwrap()
            .id;
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        let worker = Worker::builder(db.pool(8))
            .queue("at")
            .threads(1)
            // Long enough that a run on a machine at load 14 records its failure well inside
            // it (0.9 s lapsed there once), short enough that a lapse shows within the wait.
            .claim_ttl(Duration::from_secs(5))
            .poll_interval(Duration::from_millis(10))
            .raw_handler("k", move |_: &JobContext, _: &[u8]| {
                r.fetch_add(1, Ordering::SeqCst);
                Err(JobError::retry_at("retry at an odd instant", at))
            })
            .kind_backoff("k", hour)
            .start()
            .unwrap();
        // Recorded at once when it works; a refused record is given up after 3 tries and
        // its claim lapses (5 s) and is rescued (every 2.5 s): 12 s shows that.
        let report = wait_for(&worker, Duration::from_secs(12), |r| r.retried + r.dead > 0);
        std::thread::sleep(Duration::from_millis(300));
        let report2 = worker.shutdown(Duration::from_secs(5));
        let job = jobs::get(&mut conn, id);
        let ok = match &job {
            // Recorded as asked (an instant in the past is due at once) or per the kind's
            // backoff; never by letting the claim lapse, and a future instant never runs
            // the job again at once.
            Ok(Some(job)) => {
                job.lapses == 0
                    && (at <= Utc::now()
                        || (job.state == JobState::Waiting
                            && job.attempt == 1
                            && job.due_at > Utc::now() + chrono::Duration::minutes(30)
                            && runs.load(Ordering::SeqCst) == 1
                            && report.retried == 1))
            }
            _ => false,
        };
        if !ok {
            failures.push(format!(
                "{name} ({at}): runs {}, report {report2:?}, job {job:?}",
                runs.load(Ordering::SeqCst)
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A retry instant past year 9999 on one job must not hold up other jobs of the queue. On
/// MariaDB the DATETIME column takes it as the zero date `0000-00-00`, which sorts first and
/// cannot be read back: every claim that picks the job fails after marking its whole batch
/// running, so the good jobs claimed with it are never handed out and lapse, again and
/// again. 50 good jobs enqueued after the bad record must all complete, none with a lapse.
fn a_refused_retry_instant_does_not_block_other_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let bad = jobs::enqueue(
        &mut conn,
        &NewJob::new("mix", "bad", vec![]).max_attempts(3),
    )
    .unwrap()
    .id;
    let hour = Backoff {
        base: Duration::from_secs(3600),
        max: Duration::from_secs(3600),
    };
    let far = Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap();
    let worker = Worker::builder(db.pool(8))
        .queue("mix")
        .threads(2)
        // Not shorter: on a machine at load 14 a good job's claim must not lapse by itself.
        .claim_ttl(Duration::from_secs(5))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("bad", move |_: &JobContext, _: &[u8]| {
            Err(JobError::retry_at("in year 10000", far))
        })
        .kind_backoff("bad", hour)
        .raw_handler("ok", |_: &JobContext, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(5));
            Ok(())
        })
        .start()
        .unwrap();
    let first = wait_for(&worker, Duration::from_secs(20), |r| r.retried + r.dead > 0);
    assert!(first.retried + first.dead > 0, "{first:?}");
    let batch: Vec<NewJob> = (0..50).map(|_| NewJob::new("mix", "ok", vec![])).collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    // Runs in well under a second; 30 s covers several lapses (5 s ttl) if they happen.
    let report = wait_for(&worker, Duration::from_secs(30), |r| r.completed >= 50);
    let final_report = worker.shutdown(Duration::from_secs(5));
    let completed = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'",
    );
    let lapsed = count(
        &mut conn,
        &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses > 0 AND id <> {bad}"),
    );
    let bad_job = jobs::get(&mut conn, bad);
    assert_eq!(
        (completed, lapsed),
        (50, 0),
        "(completed, lapsed good jobs); report {report:?} / {final_report:?}; bad job {bad_job:?}"
    );
}

/// Two workers on one queue; every job's first run fails with a retry due at once, so both
/// workers race for the retries while their first runs are being recorded. Each job runs
/// exactly twice (attempts 1 and 2), ends completed, and the two reports add up exactly.
fn two_workers_with_retries_due_at_once_run_each_attempt_once(backend: Backend) {
    const JOBS: usize = 600;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("again", "k", vec![]).max_attempts(2))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let runs: Arc<Mutex<HashMap<i64, Vec<u32>>>> = Arc::default();
    let start = |runs: Arc<Mutex<HashMap<i64, Vec<u32>>>>| {
        Worker::builder(db.pool(12))
            .queue("again")
            .threads(4)
            // 5 s, not 1: at load 10 heartbeats missed 1 s windows, so claims lapsed and
            // runs were (rightly) repeated, which is not what this test looks at.
            .claim_ttl(Duration::from_secs(5))
            .poll_interval(Duration::from_millis(10))
            .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
                runs.lock()
                    .unwrap()
                    .entry(ctx.id)
                    .or_default()
                    .push(ctx.attempt);
                if ctx.attempt == 1 {
                    return Err(JobError::retry_at("first run fails", DateTime::UNIX_EPOCH));
                }
                Ok(())
            })
            .start()
            .unwrap()
    };
    let a = start(runs.clone());
    let b = start(runs.clone());
    crate::common::live_jobs_after(&mut conn, Duration::from_secs(60));
    // Past a ttl and a rescue period: an orphaned claim would have lapsed and rerun.
    std::thread::sleep(Duration::from_millis(7500));
    let (ra, rb) = (
        a.shutdown(Duration::from_secs(5)),
        b.shutdown(Duration::from_secs(5)),
    );
    let runs = runs.lock().unwrap();
    let wrong: Vec<_> = runs.iter().filter(|(_, a)| **a != vec![1, 2]).collect();
    assert!(wrong.is_empty(), "{wrong:?}; A {ra:?}, B {rb:?}");
    assert_eq!(runs.len(), JOBS);
    assert_eq!(ra.completed + rb.completed, JOBS, "A {ra:?}, B {rb:?}");
    assert_eq!(ra.retried + rb.retried, JOBS, "A {ra:?}, B {rb:?}");
    assert_eq!(
        ra.lost + rb.lost + ra.dead + rb.dead,
        0,
        "A {ra:?}, B {rb:?}"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed' AND lapses = 0"
        ),
        JOBS as i64
    );
}

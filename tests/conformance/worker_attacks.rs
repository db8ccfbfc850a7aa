//! Attacks on the worker's promises (an outside tester's suite): shutdown while a handler
//! holds a limit key, cancels at shutdown, retry instants the database refuses, claims lost
//! and re-claimed by the same worker, retries due at once on two workers, and exact report
//! counts. Each test that failed when written was fixed in the library; all now hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, TimeZone, Utc};
use diesel::connection::SimpleConnection;
use tenure::Backend;
use tenure::jobs::{self, Backoff, JobState, NewJob};
use tenure::worker::{JobContext, JobError, Report, Worker};

use crate::common::{Intervals, TestDb, conformance, count, overlaps, wait_for};

conformance!(
    shutdown_past_grace_keeps_the_limit_until_the_handler_returns,
    shutdown_past_grace_never_runs_a_job_twice_at_once,
    a_cancel_at_shutdown_is_counted_and_ends_the_job_cancelled,
    a_refused_retry_instant_falls_back_to_the_kinds_backoff,
    a_refused_retry_instant_does_not_block_other_jobs,
    a_lost_claim_reclaimed_by_the_same_worker_runs_and_counts_once_each,
    two_workers_with_retries_due_at_once_run_each_attempt_once,
    a_cancelled_claimed_ahead_job_never_runs,
    a_cancelled_run_that_panics_is_not_counted_as_retried_or_panicked_alone,
    limits_hold_across_two_workers_with_timeouts,
);

fn wait_flag(flag: &AtomicBool, limit: Duration) {
    let until = Clock::now() + limit;
    while !flag.load(Ordering::SeqCst) {
        assert!(Clock::now() < until, "timed out waiting for a flag");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Under `limit(key, 1)`, worker A runs a handler that ignores `should_stop` for 1.5 s and is
/// shut down with no grace. The shutdown gives the job back while its handler still runs, so
/// the key's slot is free: worker B starts a second job of the key (and the given-back job
/// itself) while A's handler still runs. "At most n handlers of a key run at once, across
/// workers and processes" does not hold across a shutdown.
fn shutdown_past_grace_keeps_the_limit_until_the_handler_returns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let first = jobs::enqueue(
        &mut conn,
        &NewJob::new("lim", "k", vec![]).limit("one", 1).priority(-1),
    )
    .unwrap()
    .id;
    jobs::enqueue(&mut conn, &NewJob::new("lim", "k", vec![]).limit("one", 1)).unwrap();
    let intervals: Intervals = Arc::default();
    let started = Arc::new(AtomicBool::new(false));
    let handler = {
        let (seen, started) = (intervals.clone(), started.clone());
        move |ctx: &JobContext, _: &[u8]| {
            let start = Clock::now();
            if ctx.id == first && !started.swap(true, Ordering::SeqCst) {
                // The first run ignores should_stop: a slow cleanup.
                std::thread::sleep(Duration::from_millis(1500));
            } else {
                std::thread::sleep(Duration::from_millis(50));
            }
            seen.lock().unwrap().push((ctx.id, start, Clock::now()));
            Ok(())
        }
    };
    let a = Worker::builder(db.pool(8))
        .queue("lim")
        .threads(2)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler.clone())
        .start()
        .unwrap();
    wait_flag(&started, Duration::from_secs(20));
    let report_a = a.shutdown(Duration::ZERO);
    let b = Worker::builder(db.pool(8))
        .queue("lim")
        .threads(2)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler)
        .start()
        .unwrap();
    let until = Clock::now() + Duration::from_secs(30);
    while intervals.lock().unwrap().len() < 3 && Clock::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let report_b = b.shutdown(Duration::from_secs(5));
    let intervals = intervals.lock().unwrap();
    assert_eq!(
        overlaps(&intervals),
        vec![],
        "two handlers of a limit-1 key ran at once: A {report_a:?}, B {report_b:?}"
    );
}

/// The same shutdown, without limits: the given-back job is claimed by another worker and
/// its handler starts while the first run's handler (which ignores should_stop) still runs:
/// one job run twice at once. A run past the grace period keeps no claim.
fn shutdown_past_grace_never_runs_a_job_twice_at_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("twice", "k", vec![]))
        .unwrap()
        .id;
    let intervals: Intervals = Arc::default();
    let started = Arc::new(AtomicBool::new(false));
    let handler = {
        let (seen, started) = (intervals.clone(), started.clone());
        move |ctx: &JobContext, _: &[u8]| {
            let start = Clock::now();
            if !started.swap(true, Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1500));
            }
            seen.lock().unwrap().push((ctx.id, start, Clock::now()));
            Ok(())
        }
    };
    let a = Worker::builder(db.pool(8))
        .queue("twice")
        .threads(1)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler.clone())
        .start()
        .unwrap();
    wait_flag(&started, Duration::from_secs(20));
    let report_a = a.shutdown(Duration::ZERO);
    let b = Worker::builder(db.pool(8))
        .queue("twice")
        .threads(1)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler)
        .start()
        .unwrap();
    let until = Clock::now() + Duration::from_secs(20);
    while intervals.lock().unwrap().len() < 2 && Clock::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let report_b = b.shutdown(Duration::from_secs(5));
    let intervals = intervals.lock().unwrap();
    assert_eq!(
        overlaps(&intervals),
        vec![],
        "job {id} ran twice at once: A {report_a:?}, B {report_b:?}"
    );
}

/// A running job is asked to cancel, then its worker shuts down with no grace while the
/// handler still runs (ignoring should_stop). The worker does not give it back while the
/// handler may still work on it (no second run, limit slot kept): its claim lapses and the
/// rescue cancels the job. The report counts no end the worker did not record.
fn a_cancel_at_shutdown_is_counted_and_ends_the_job_cancelled(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("cx", "k", vec![]))
        .unwrap()
        .id;
    let started = Arc::new(AtomicBool::new(false));
    let release = Arc::new(AtomicBool::new(false));
    let (s, r) = (started.clone(), release.clone());
    let worker = Worker::builder(db.pool(8))
        .queue("cx")
        .threads(1)
        .claim_ttl(Duration::from_millis(600))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", move |_: &JobContext, _: &[u8]| {
            s.store(true, Ordering::SeqCst);
            let until = Clock::now() + Duration::from_secs(20);
            while !r.load(Ordering::SeqCst) && Clock::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        })
        .start()
        .unwrap();
    wait_flag(&started, Duration::from_secs(20));
    assert!(jobs::cancel(&mut conn, id).unwrap());
    let report = worker.shutdown(Duration::ZERO);
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(
        job.state,
        JobState::Running,
        "held while its handler runs: {report:?}"
    );
    assert!(job.cancel_requested_at.is_some());
    assert_eq!((report.cancelled, report.given_back), (0, 0), "{report:?}");
    let until = Clock::now() + Duration::from_secs(20);
    let mut rescued = Vec::new();
    while rescued.is_empty() && Clock::now() < until {
        std::thread::sleep(Duration::from_millis(100));
        rescued = jobs::rescue(&mut conn, 10).unwrap().cancelled;
    }
    release.store(true, Ordering::SeqCst);
    assert_eq!(rescued, vec![id]);
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Cancelled, "{report:?}");
}

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
            .claim_ttl(Duration::from_millis(900))
            .poll_interval(Duration::from_millis(10))
            .raw_handler("k", move |_: &JobContext, _: &[u8]| {
                r.fetch_add(1, Ordering::SeqCst);
                Err(JobError::retry_at("retry at an odd instant", at))
            })
            .kind_backoff("k", hour)
            .start()
            .unwrap();
        // Recorded at once when it works; a refused record is given up after 3 tries and
        // its claim lapses (0.9 s) and is rescued: 4 s shows that.
        let report = wait_for(&worker, Duration::from_secs(4), |r| r.retried + r.dead > 0);
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
        .claim_ttl(Duration::from_millis(900))
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
    // Runs in well under a second; 10 s covers several lapses (0.9 s ttl) if they happen.
    let report = wait_for(&worker, Duration::from_secs(10), |r| r.completed >= 50);
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

/// Forces a job's claim to lapse and rescues it (as if the worker stalled) while its handler
/// still runs; the same worker claims it again (another entry: job id + new token) and runs
/// it in a second thread. The stale run hears `should_stop`, returns later, and is counted
/// lost; the new run completes. Several rounds, each old run returning before or after the
/// new one.
fn a_lost_claim_reclaimed_by_the_same_worker_runs_and_counts_once_each(backend: Backend) {
    const ROUNDS: usize = 4;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let runs: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let stale_saw_stop = Arc::new(AtomicUsize::new(0));
    let new_done: Arc<Mutex<HashMap<i64, bool>>> = Arc::default();
    let lost_claim = Arc::new(AtomicBool::new(false));
    let (seen, stopped, done, lost) = (
        runs.clone(),
        stale_saw_stop.clone(),
        new_done.clone(),
        lost_claim.clone(),
    );
    let worker = Worker::builder(db.pool(8))
        .queue("lost")
        .threads(3)
        .claim_ttl(Duration::from_millis(900))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", move |ctx: &JobContext, payload: &[u8]| {
            let n = {
                let mut runs = seen.lock().unwrap();
                let n = runs.entry(ctx.id).or_default();
                *n += 1;
                *n
            };
            if n == 1 {
                // The stale run: wait until the test took the claim away and the worker
                // told us, then (odd rounds) until the new run completed.
                lost.store(true, Ordering::SeqCst);
                let until = Clock::now() + Duration::from_secs(15);
                while !ctx.should_stop() && Clock::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if ctx.should_stop() {
                    stopped.fetch_add(1, Ordering::SeqCst);
                }
                if payload == b"late" {
                    while !done.lock().unwrap().get(&ctx.id).copied().unwrap_or(false)
                        && Clock::now() < until
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                return Ok(());
            }
            if payload == b"early" {
                std::thread::sleep(Duration::from_millis(400));
            }
            done.lock().unwrap().insert(ctx.id, true);
            Ok(())
        })
        .start()
        .unwrap();
    let mut ids = Vec::new();
    for round in 0..ROUNDS {
        lost_claim.store(false, Ordering::SeqCst);
        let payload: &[u8] = if round % 2 == 0 { b"late" } else { b"early" };
        let id = jobs::enqueue(&mut conn, &NewJob::new("lost", "k", payload.to_vec()))
            .unwrap()
            .id;
        ids.push(id);
        wait_flag(&lost_claim, Duration::from_secs(20));
        // Take the claim away: lapse it (the heartbeat may renew it in between: again).
        let until = Clock::now() + Duration::from_secs(20);
        loop {
            conn.batch_execute(&format!(
                "UPDATE tenure_jobs SET claim_expires_at = created_at WHERE id = {id}"
            ))
            .unwrap();
            let rescued = jobs::rescue(&mut conn, 10).unwrap();
            if rescued.requeued == vec![id] {
                break;
            }
            assert!(Clock::now() < until, "could not rescue job {id}");
        }
        let until = Clock::now() + Duration::from_secs(20);
        while jobs::get(&mut conn, id).unwrap().unwrap().state != JobState::Completed {
            assert!(Clock::now() < until, "job {id} did not complete");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let report = wait_for(&worker, Duration::from_secs(20), |r| {
        r.lost >= ROUNDS && r.completed >= ROUNDS
    });
    std::thread::sleep(Duration::from_millis(1500));
    let final_report = worker.shutdown(Duration::from_secs(5));
    assert_eq!(report, final_report, "nothing after the rounds");
    let runs = runs.lock().unwrap();
    for id in &ids {
        assert_eq!(
            runs.get(id),
            Some(&2),
            "job {id}: {runs:?}, {final_report:?}"
        );
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        assert_eq!(job.state, JobState::Completed, "{job:?}");
        assert_eq!(job.attempt, 1, "the lapse used no attempt: {job:?}");
    }
    assert_eq!(stale_saw_stop.load(Ordering::SeqCst), ROUNDS);
    assert_eq!(
        final_report,
        Report {
            completed: ROUNDS,
            lost: ROUNDS,
            ..Report::default()
        }
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
            .claim_ttl(Duration::from_secs(1))
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
    let until = Clock::now() + Duration::from_secs(60);
    loop {
        let live = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
        );
        if live == 0 || Clock::now() > until {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Past a ttl and a rescue period: an orphaned claim would have lapsed and rerun.
    std::thread::sleep(Duration::from_millis(2500));
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

/// A worker with one thread claims short jobs ahead; one of the claimed-ahead jobs is
/// cancelled (a cancel request: it is `running` in the database) while a long job holds the
/// thread. It must never run, end cancelled, and use no attempt.
fn a_cancelled_claimed_ahead_job_never_runs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // Warm-up: short runs make the worker claim ahead.
    let warm: Vec<NewJob> = (0..200)
        .map(|_| NewJob::new("ahead", "quick", vec![]))
        .collect();
    jobs::enqueue_many(&mut conn, &warm).unwrap();
    let ran: Arc<Mutex<Vec<i64>>> = Arc::default();
    let blocking = Arc::new(AtomicBool::new(false));
    let release = Arc::new(AtomicBool::new(false));
    let (seen, b, r) = (ran.clone(), blocking.clone(), release.clone());
    let worker = Worker::builder(db.pool(8))
        .queue("ahead")
        .threads(1)
        .claim_ttl(Duration::from_millis(600))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("quick", |_: &JobContext, _: &[u8]| Ok(()))
        .raw_handler("block", move |_: &JobContext, _: &[u8]| {
            b.store(true, Ordering::SeqCst);
            let until = Clock::now() + Duration::from_secs(20);
            while !r.load(Ordering::SeqCst) && Clock::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        })
        .raw_handler("target", move |ctx: &JobContext, _: &[u8]| {
            seen.lock().unwrap().push(ctx.id);
            Ok(())
        })
        .start()
        .unwrap();
    wait_for(&worker, Duration::from_secs(20), |r| r.completed >= 200);
    // The blocker first, then targets behind it in one claim. Whether a claim takes targets
    // ahead depends on the moving average of run times: a round with none is run again.
    let mut claimed_ahead: Vec<i64> = Vec::new();
    let mut rounds = 0;
    for _round in 0..5 {
        rounds += 1;
        let mut batch = vec![NewJob::new("ahead", "block", vec![]).priority(-1)];
        batch.extend((0..20).map(|_| NewJob::new("ahead", "target", vec![])));
        let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect();
        wait_flag(&blocking, Duration::from_secs(20));
        // Some targets are claimed ahead (running in the database, not started).
        std::thread::sleep(Duration::from_millis(200));
        claimed_ahead = ids[1..]
            .iter()
            .copied()
            .filter(|id| jobs::get(&mut conn, *id).unwrap().unwrap().state == JobState::Running)
            .collect();
        if !claimed_ahead.is_empty() {
            break;
        }
        release.store(true, Ordering::SeqCst);
        let until = Clock::now() + Duration::from_secs(20);
        while count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
        ) > 0
            && Clock::now() < until
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        blocking.store(false, Ordering::SeqCst);
        release.store(false, Ordering::SeqCst);
    }
    for id in &claimed_ahead {
        assert!(jobs::cancel(&mut conn, *id).unwrap());
    }
    // Past a few heartbeats (ttl/3 = 200 ms).
    std::thread::sleep(Duration::from_millis(1000));
    release.store(true, Ordering::SeqCst);
    let until = Clock::now() + Duration::from_secs(20);
    while count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
    ) > 0
        && Clock::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = worker.shutdown(Duration::from_secs(5));
    let ran = ran.lock().unwrap();
    let wrongly_ran: Vec<_> = claimed_ahead.iter().filter(|id| ran.contains(id)).collect();
    assert!(
        !claimed_ahead.is_empty(),
        "no job was claimed ahead: {report:?}"
    );
    assert!(
        wrongly_ran.is_empty(),
        "{wrongly_ran:?} of {claimed_ahead:?}; {report:?}"
    );
    for id in &claimed_ahead {
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        assert_eq!(job.state, JobState::Cancelled, "{job:?}");
    }
    assert_eq!(
        report.completed,
        // Every round enqueued a blocker and 20 targets; rounds without targets claimed
        // ahead ran them all.
        200 + rounds * (1 + 20) - claimed_ahead.len(),
        "{report:?}"
    );
    assert_eq!(report.cancelled, claimed_ahead.len(), "{report:?}");
}

/// A cancelled run whose handler then panics (and another that passes its timeout): the job
/// ends cancelled. The report documents panicked and timed_out as "also counted as retried
/// or dead"; here neither is retried nor dead, so the counts do not add up.
fn a_cancelled_run_that_panics_is_not_counted_as_retried_or_panicked_alone(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("cp", "k", vec![]))
        .unwrap()
        .id;
    let started = Arc::new(AtomicBool::new(false));
    let s = started.clone();
    let worker = Worker::builder(db.pool(8))
        .queue("cp")
        .threads(1)
        .claim_ttl(Duration::from_millis(600))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            s.store(true, Ordering::SeqCst);
            let until = Clock::now() + Duration::from_secs(20);
            while !ctx.should_stop() && Clock::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            panic!("stopping badly");
        })
        .start()
        .unwrap();
    wait_flag(&started, Duration::from_secs(20));
    assert!(jobs::cancel(&mut conn, id).unwrap());
    wait_for(&worker, Duration::from_secs(20), |r| r.cancelled == 1);
    std::thread::sleep(Duration::from_millis(200));
    let report = worker.shutdown(Duration::from_secs(5));
    assert_eq!(
        jobs::get(&mut conn, id).unwrap().unwrap().state,
        JobState::Cancelled
    );
    assert_eq!(report.cancelled, 1, "{report:?}");
    assert!(
        report.panicked <= report.retried + report.dead + report.cancelled + report.lost,
        "panicked is documented as also counted under how the run was recorded: {report:?}"
    );
}

/// Two workers, limit(key, 2), a timeout every handler overruns (ignoring should_stop for
/// a while), retries due almost at once: at no moment do more than 2 handlers of the key run,
/// across both workers.
fn limits_hold_across_two_workers_with_timeouts(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..8)
        .map(|_| {
            NewJob::new("lim2", "slow", vec![])
                .limit("two", 2)
                // Room for extra timeouts on a loaded machine: runs are counted, not timed.
                .max_attempts(20)
        })
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let start = || {
        let (running, most, ran) = (running.clone(), most.clone(), ran.clone());
        Worker::builder(db.pool(8))
            .queue("lim2")
            .threads(3)
            .claim_ttl(Duration::from_millis(600))
            .poll_interval(Duration::from_millis(5))
            .raw_handler("slow", move |ctx: &JobContext, _: &[u8]| {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let dur = if ctx.attempt == 1 { 400 } else { 0 };
                std::thread::sleep(Duration::from_millis(dur));
                running.fetch_sub(1, Ordering::SeqCst);
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .kind_backoff(
                "slow",
                Backoff {
                    base: Duration::from_millis(1),
                    max: Duration::from_millis(1),
                },
            )
            .timeout("slow", Duration::from_millis(100))
            .start()
            .unwrap()
    };
    let (a, b) = (start(), start());
    let until = Clock::now() + Duration::from_secs(60);
    while count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
    ) > 0
        && Clock::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ra, rb) = (
        a.shutdown(Duration::from_secs(5)),
        b.shutdown(Duration::from_secs(5)),
    );
    assert!(
        most.load(Ordering::SeqCst) <= 2,
        "{} handlers of a limit-2 key at once; A {ra:?}, B {rb:?}",
        most.load(Ordering::SeqCst)
    );
    // Every first run times out; a later one may too on a loaded machine. Each run is
    // recorded once: timed out or completed.
    let timed_out = ra.timed_out + rb.timed_out;
    assert!(timed_out >= 8, "A {ra:?}, B {rb:?}");
    assert_eq!(ra.completed + rb.completed, 8, "A {ra:?}, B {rb:?}");
    assert_eq!(ran.load(Ordering::SeqCst), timed_out + 8);
}

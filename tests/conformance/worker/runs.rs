//! The worker's table of runs: keyed by the claim, one owner per transition. Regression tests
//! for retries claimed while an earlier run is still being recorded, results the database
//! cannot store, attempts charged to jobs that never started, and limits held until the
//! handler really returns.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, Utc};
use tenure::jobs::{self, Backoff, JobState, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend};

use crate::common::{Intervals, TestDb, conformance, count, overlaps, poll_until};

conformance!(
    a_retry_claimed_while_the_first_run_is_recorded_runs_once,
    a_result_the_database_refuses_does_not_block_the_others,
    the_builder_refuses_a_backoff_no_retry_could_use,
    a_lapsed_claim_uses_no_attempt,
    a_job_whose_claims_keep_lapsing_ends_dead,
    a_timed_out_run_holds_its_limit_until_the_handler_returns,
    a_cancelled_run_holds_its_limit_until_the_handler_returns,
);

/// The first run of every job fails with a retry due at once, so this same worker claims the
/// retry while the first run may still be waiting for the finisher. Keyed by job id, the
/// retry's entry was overwritten or removed: its completion was dropped and it lapsed, was
/// rescued and ran a third time, or ended dead although its second run succeeded.
fn a_retry_claimed_while_the_first_run_is_recorded_runs_once(backend: Backend) {
    // 1,000 (two runs each) passed nextest's minute on MariaDB at load 20.
    const JOBS: usize = 500;
    let db = TestDb::migrated(backend);
    let pool = db.pool(16);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("again", "k", vec![]).max_attempts(2))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let runs: Arc<Mutex<HashMap<i64, Vec<u32>>>> = Arc::default();
    let seen = runs.clone();
    let worker = Worker::builder(pool)
        .queue("again")
        .threads(8)
        // Short enough that an orphaned claim lapses and is rescued within the test's wait
        // for the jobs to end (a dropped completion leaves its job running until then), long
        // enough that heartbeats delayed by a loaded machine's disk keep the others (3 s lapsed
        // a hundred claims while CI built beside the suite).
        .claim_ttl(Duration::from_secs(10))
        .poll_interval(Duration::from_millis(20))
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            seen.lock()
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
        .unwrap();
    // A job whose completion was dropped stays running until its claim lapses, is rescued
    // and runs again: it is live until then, so once none is live, none can run again.
    let live = crate::common::live_jobs_after(&mut conn, Duration::from_secs(45));
    let report = worker.shutdown(Duration::from_secs(5));
    assert_eq!(live, 0, "{report:?}");
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'"
        ),
        JOBS as i64,
        "every second run succeeded: none may end dead ({report:?})"
    );
    let runs = runs.lock().unwrap();
    let wrong: Vec<_> = runs.iter().filter(|(_, r)| **r != [1, 2]).collect();
    assert!(wrong.is_empty(), "runs other than [1, 2]: {wrong:?}");
    assert_eq!(runs.len(), JOBS);
    assert_eq!(
        (report.completed, report.retried, report.lost),
        (JOBS, JOBS, 0)
    );
}

/// A retry instant no backend can store and a message with NUL (PostgreSQL's text refuses
/// it) are recorded anyway (the retry per the kind's policy, the message cleaned), and the
/// hundreds of other results around them are recorded as they come.
fn a_result_the_database_refuses_does_not_block_the_others(backend: Backend) {
    const JOBS: usize = 1500;
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = db.connect();
    let bad_instant = jobs::enqueue(&mut conn, &NewJob::new("mixed", "never", vec![]))
        .unwrap()
        .id;
    let bad_text = jobs::enqueue(&mut conn, &NewJob::new("mixed", "nul", vec![]))
        .unwrap()
        .id;
    let bad_panic = jobs::enqueue(&mut conn, &NewJob::new("mixed", "panic", vec![]))
        .unwrap()
        .id;
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("mixed", "ok", vec![]))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let hour = Backoff {
        base: Duration::from_secs(3600),
        max: Duration::from_secs(3600),
    };
    let worker = Worker::builder(db.pool(8))
        .queue("mixed")
        .threads(4)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("never", |_: &JobContext, _: &[u8]| {
            Err(JobError::retry_at("never again", DateTime::<Utc>::MAX_UTC))
        })
        .kind_backoff("never", hour)
        .raw_handler("nul", |_: &JobContext, _: &[u8]| {
            Err(JobError::retry("a message\0with NUL"))
        })
        .kind_backoff("nul", hour)
        .raw_handler("panic", |_: &JobContext, _: &[u8]| {
            panic!("a panic\0with NUL")
        })
        .kind_backoff("panic", hour)
        .raw_handler("ok", |_: &JobContext, _: &[u8]| Ok(()))
        .start()
        .unwrap();
    let done = |c: &mut AnyConnection| {
        count(
            c,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running' OR \
             (state = 'waiting' AND attempt = 0)",
        )
    };
    poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
        (done(&mut conn) == 0).then_some(())
    });
    let report = worker.shutdown(Duration::from_secs(5));
    drop(pool);
    assert_eq!(report.completed, JOBS, "{report:?}");
    assert_eq!(report.retried, 3, "{report:?}");
    for id in [bad_instant, bad_text, bad_panic] {
        let job = jobs::get(&mut conn, id).unwrap().unwrap();
        assert_eq!(job.state, JobState::Waiting, "job {id}: {job:?}");
        assert_eq!(job.attempt, 1);
        // The kind's backoff (an hour, jittered down to half) from the failure, which came
        // after the claim: both on the database's clock (the client's "now" read later
        // would make this depend on how fast the machine is).
        let claimed_at = job.claimed_at.expect("claimed once");
        assert!(
            job.due_at
                >= claimed_at + chrono::Duration::minutes(30) - chrono::Duration::milliseconds(1),
            "{job:?}"
        );
    }
    let text = jobs::get(&mut conn, bad_text).unwrap().unwrap();
    assert_eq!(
        text.last_error.as_deref(),
        Some("a message\u{fffd}with NUL")
    );
    let history = jobs::history(&mut conn, bad_panic).unwrap();
    assert!(
        history[0].error.contains("a panic\u{fffd}with NUL"),
        "{history:?}"
    );
    let instant = jobs::get(&mut conn, bad_instant).unwrap().unwrap();
    assert!(
        instant
            .last_error
            .as_deref()
            .unwrap()
            .contains("never again"),
        "{instant:?}"
    );
}

/// A per-kind or default backoff whose delay no retry could be stored with is refused when
/// the worker is built, not discovered at the first failure.
fn the_builder_refuses_a_backoff_no_retry_could_use(backend: Backend) {
    let db = TestDb::migrated(backend);
    let too_long = Backoff {
        base: Duration::from_secs(1),
        max: Duration::from_secs(367 * 24 * 3600),
    };
    let per_kind = Worker::builder(db.pool(8))
        .queue("q")
        .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
        .kind_backoff("k", too_long)
        .start();
    assert!(
        per_kind
            .as_ref()
            .err()
            .is_some_and(|e| e.is_invalid_input()),
        "{:?}",
        per_kind.err()
    );
    let default = Worker::builder(db.pool(8))
        .queue("q")
        .backoff(too_long)
        .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
        .drain();
    assert!(
        default.as_ref().err().is_some_and(|e| e.is_invalid_input()),
        "{default:?}"
    );
}

/// Claims that lapse (a worker that died holding them, started or not) are returned without
/// using an attempt, so jobs claimed ahead and never started keep theirs: with one attempt
/// each, a crash leaves every job waiting, none dead.
fn a_lapsed_claim_uses_no_attempt(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..10)
        .map(|_| NewJob::new("ahead", "k", vec![]).max_attempts(1))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let claimed = jobs::claim(&mut conn, "ahead", 10, Duration::from_millis(50)).unwrap();
    assert_eq!(claimed.len(), 10);
    std::thread::sleep(Duration::from_millis(300));
    let rescued = jobs::rescue(&mut conn, 100).unwrap();
    assert_eq!(rescued.requeued.len(), 10, "{rescued:?}");
    assert!(rescued.dead.is_empty(), "{rescued:?}");
    let again = jobs::claim(&mut conn, "ahead", 10, Duration::from_secs(60)).unwrap();
    assert_eq!(again.len(), 10);
    assert!(again.iter().all(|j| j.attempt == 1), "{again:?}");
    let claims: Vec<_> = again.iter().map(|j| j.claim()).collect();
    jobs::complete(&mut conn, &claims).unwrap();
    // The lapse is in each job's history.
    let history = jobs::history(&mut conn, again[0].id).unwrap();
    assert_eq!(history.len(), 1);
    assert!(history[0].error.contains("lapsed"), "{history:?}");
}

/// A job that takes its worker down every time (a poison pill) still ends: dead after
/// [`jobs::MAX_LAPSES`] lapsed claims, whatever its attempts.
fn a_job_whose_claims_keep_lapsing_ends_dead(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(
        &mut conn,
        &NewJob::new("pill", "k", vec![]).max_attempts(100),
    )
    .unwrap()
    .id;
    for lapse in 1..=jobs::MAX_LAPSES {
        let claimed = jobs::claim(&mut conn, "pill", 1, Duration::from_millis(20)).unwrap();
        assert_eq!(claimed.len(), 1, "lapse {lapse}");
        std::thread::sleep(Duration::from_millis(150));
        let rescued = jobs::rescue(&mut conn, 10).unwrap();
        if lapse < jobs::MAX_LAPSES {
            assert_eq!(rescued.requeued, vec![id], "lapse {lapse}");
        } else {
            assert_eq!(rescued.dead, vec![id], "lapse {lapse}");
        }
    }
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
}

/// Under `limit(key, 1)`, a run past its timeout whose handler ignores `should_stop` for a
/// while still holds the key: no other job of the key (nor its own retry) starts until it
/// returns. Failing the run at the timeout freed the slot while the handler kept running.
fn a_timed_out_run_holds_its_limit_until_the_handler_returns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for _ in 0..3 {
        jobs::enqueue(
            &mut conn,
            &NewJob::new("lim", "slow", vec![]).limit("one", 1),
        )
        .unwrap();
    }
    let intervals: Intervals = Arc::default();
    let seen = intervals.clone();
    let worker = Worker::builder(db.pool(8))
        .queue("lim")
        .threads(3)
        // 5 s, not 600 ms: at load 10 the heartbeat missed a 600 ms window, the claim
        // lapsed and a second run (rightly) started: not what this test looks at.
        .claim_ttl(Duration::from_secs(5))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("slow", move |ctx: &JobContext, _: &[u8]| {
            let start = Clock::now();
            // Ignores should_stop: 4x its timeout.
            std::thread::sleep(Duration::from_millis(800));
            seen.lock().unwrap().push((ctx.id, start, Clock::now()));
            Ok(())
        })
        .kind_backoff(
            "slow",
            Backoff {
                base: Duration::from_millis(1),
                max: Duration::from_millis(1),
            },
        )
        .timeout("slow", Duration::from_millis(200))
        .start()
        .unwrap();
    poll_until(Duration::from_secs(30), Duration::from_millis(20), || {
        (intervals.lock().unwrap().len() >= 4).then_some(())
    });
    let report = worker.shutdown(Duration::from_secs(5));
    let intervals = intervals.lock().unwrap();
    assert!(intervals.len() >= 4, "{report:?}");
    assert!(report.timed_out >= 3, "{report:?}");
    assert_eq!(overlaps(&intervals), vec![], "{report:?}");
}

/// Under `limit(key, 1)`, a cancelled run holds the key until its handler returns (it hears
/// the cancel at the next heartbeat, and may take a while to stop): the next job of the key
/// starts only after. The job ends cancelled.
fn a_cancelled_run_holds_its_limit_until_the_handler_returns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = db.connect();
    let first = jobs::enqueue(
        &mut conn,
        &NewJob::new("lim", "k", vec![]).limit("one", 1).priority(-1),
    )
    .unwrap()
    .id;
    let second = jobs::enqueue(&mut conn, &NewJob::new("lim", "k", vec![]).limit("one", 1))
        .unwrap()
        .id;
    let intervals: Intervals = Arc::default();
    let started = Arc::new(AtomicUsize::new(0));
    let (seen, s) = (intervals.clone(), started.clone());
    let worker = Worker::builder(pool.clone())
        .queue("lim")
        .threads(2)
        .claim_ttl(Duration::from_secs(3))
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            let start = Clock::now();
            s.fetch_add(1, Ordering::SeqCst);
            poll_until(Duration::from_secs(10), Duration::from_millis(5), || {
                (ctx.should_stop() || ctx.id == second).then_some(())
            });
            // Cleanup after the stop flag takes a while; the key is still held.
            std::thread::sleep(Duration::from_millis(500));
            seen.lock().unwrap().push((ctx.id, start, Clock::now()));
            Ok(())
        })
        .start()
        .unwrap();
    while started.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(jobs::cancel(&mut conn, first).unwrap());
    assert!(
        !jobs::cancel(&mut conn, first).unwrap(),
        "asked once already"
    );
    poll_until(Duration::from_secs(30), Duration::from_millis(20), || {
        (intervals.lock().unwrap().len() >= 2).then_some(())
    });
    let report = worker.shutdown(Duration::from_secs(5));
    let intervals = intervals.lock().unwrap();
    assert_eq!(intervals.len(), 2, "{report:?}");
    assert_eq!(overlaps(&intervals), vec![], "{report:?}");
    assert_eq!(report.cancelled, 1, "{report:?}");
    let job = jobs::get(&mut conn, first).unwrap().unwrap();
    assert_eq!(job.state, JobState::Cancelled);
    let job = jobs::get(&mut conn, second).unwrap().unwrap();
    assert_eq!(job.state, JobState::Completed);
}

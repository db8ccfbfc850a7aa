//! A worker's shutdown past its grace: the limit is kept until the handler returns, no job runs
//! twice at once, and a cancel at shutdown is counted and ends the job cancelled.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant as Clock};

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, Worker};

use crate::common::{Intervals, TestDb, conformance, overlaps, poll_until, wait_until};

conformance!(
    shutdown_past_grace_keeps_the_limit_until_the_handler_returns,
    shutdown_past_grace_never_runs_a_job_twice_at_once,
    a_cancel_at_shutdown_is_counted_and_ends_the_job_cancelled,
);

/// The first worker's claim ttl: its slow handler (1.5 s) ends well before the claim lapses.
const LAPSING_TTL: Duration = Duration::from_secs(6);
/// The second worker's: it looks for lapsed claims every second (half its ttl).
const RESCUING_TTL: Duration = Duration::from_secs(2);

fn wait_flag(flag: &AtomicBool, limit: Duration) {
    poll_until(limit, Duration::from_millis(5), || {
        flag.load(Ordering::SeqCst).then_some(())
    })
    .expect("timed out waiting for a flag");
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
    // A's claim lapses 6 s after its last renewal (4.5 s after the slow run ends, margin
    // for a loaded machine); B's rescue (every 1 s) then gives the job to B: the test sees
    // the rerun instead of waiting out the default 30 s ttl.
    let a = Worker::builder(db.pool(8))
        .queue("lim")
        .threads(2)
        .claim_ttl(LAPSING_TTL)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler.clone())
        .start()
        .unwrap();
    wait_flag(&started, Duration::from_secs(20));
    let report_a = a.shutdown(Duration::ZERO);
    let b = Worker::builder(db.pool(8))
        .queue("lim")
        .threads(2)
        .claim_ttl(RESCUING_TTL)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler)
        .start()
        .unwrap();
    // A's slow run, B's run of the second job and B's rerun of the given-back one.
    wait_until("three runs", Duration::from_secs(60), || {
        (intervals.lock().unwrap().len() >= 3).then_some(())
    });
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
        .claim_ttl(LAPSING_TTL)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler.clone())
        .start()
        .unwrap();
    wait_flag(&started, Duration::from_secs(20));
    let report_a = a.shutdown(Duration::ZERO);
    let b = Worker::builder(db.pool(8))
        .queue("twice")
        .threads(1)
        .claim_ttl(RESCUING_TTL)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("k", handler)
        .start()
        .unwrap();
    // A's slow run, and B's run once A's claim has lapsed.
    wait_until("the rerun", Duration::from_secs(60), || {
        (intervals.lock().unwrap().len() >= 2).then_some(())
    });
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
            poll_until(Duration::from_secs(20), Duration::from_millis(5), || {
                r.load(Ordering::SeqCst).then_some(())
            });
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
    let rescued = poll_until(Duration::from_secs(20), Duration::from_millis(100), || {
        let cancelled = jobs::rescue(&mut conn, 10).unwrap().cancelled;
        (!cancelled.is_empty()).then_some(cancelled)
    })
    .unwrap_or_default();
    release.store(true, Ordering::SeqCst);
    assert_eq!(rescued, vec![id]);
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Cancelled, "{report:?}");
}

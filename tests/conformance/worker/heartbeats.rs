//! A worker's heartbeat: a long handler keeps its job, a handler past its timeout is failed
//! (and no second run starts beside it), a cancel raises the run's stop flag.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use tenure::Backend;
use tenure::jobs::{self, Backoff, JobState, NewJob};
use tenure::worker::{JobContext, Worker};

use super::pool;
use crate::common::{TestDb, conformance, poll_until, wait_for};

conformance!(
    a_long_handler_keeps_its_job_through_heartbeats,
    a_handler_past_its_timeout_is_failed_without_extra_concurrency,
    a_cancelled_job_raises_the_flag_at_the_next_heartbeat,
);

fn a_long_handler_keeps_its_job_through_heartbeats(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    // Wide enough that a heartbeat (every ttl/3) late by a second on a loaded machine still
    // renews in time: at 300 ms one was late by more than the ttl under load (claim lost).
    let ttl = Duration::from_millis(1500);
    let id = jobs::enqueue(
        &mut pool.get().unwrap(),
        &NewJob::new("long", "long", vec![]),
    )
    .unwrap()
    .id;
    let a = Worker::builder(pool.clone())
        .queue("long")
        .threads(1)
        .claim_ttl(ttl)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("long", move |ctx: &JobContext, _: &[u8]| {
            std::thread::sleep(ttl * 4);
            assert!(!ctx.should_stop(), "the heartbeat kept the claim");
            Ok(())
        })
        .start()
        .unwrap();
    // A's claimer must take the job before B starts.
    std::thread::sleep(Duration::from_millis(100));
    let stolen = Arc::new(AtomicUsize::new(0));
    let stolen_by_b = stolen.clone();
    let pool_b = db.pool(8);
    let b = Worker::builder(pool_b)
        .queue("long")
        .threads(2)
        .claim_ttl(ttl)
        .poll_interval(Duration::from_millis(10))
        .raw_handler("long", move |_: &JobContext, _: &[u8]| {
            stolen_by_b.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .start()
        .unwrap();
    let report = wait_for(&a, Duration::from_secs(40), |r| r.completed == 1);
    b.shutdown(Duration::from_secs(1));
    a.shutdown(Duration::from_secs(1));
    assert_eq!(report.completed, 1, "{report:?}");
    assert_eq!(
        stolen.load(Ordering::SeqCst),
        0,
        "the second worker got a job whose claim was renewed"
    );
    let job = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Completed, 1));
}

fn a_handler_past_its_timeout_is_failed_without_extra_concurrency(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let mut conn = pool.get().unwrap();
    let slow = jobs::enqueue(&mut conn, &NewJob::new("to", "slow", vec![]))
        .unwrap()
        .id;
    let quick = jobs::enqueue(&mut conn, &NewJob::new("to", "quick", vec![]).priority(1))
        .unwrap()
        .id;
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let saw_flag = Arc::new(AtomicBool::new(false));
    let track = |running: &AtomicUsize, most: &AtomicUsize| {
        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
        most.fetch_max(now, Ordering::SeqCst);
    };
    let (r1, m1, flag) = (running.clone(), most.clone(), saw_flag.clone());
    let (r2, m2) = (running.clone(), most.clone());
    let worker = Worker::builder(pool.clone())
        .queue("to")
        .threads(1)
        .claim_ttl(Duration::from_secs(3))
        .poll_interval(Duration::from_millis(20))
        .raw_handler("slow", move |ctx: &JobContext, _: &[u8]| {
            track(&r1, &m1);
            poll_until(Duration::from_secs(3), Duration::from_millis(10), || {
                ctx.should_stop().then_some(())
            });
            flag.store(ctx.should_stop(), Ordering::SeqCst);
            // Keep the thread busy a little past the flag: no other job may start meanwhile.
            std::thread::sleep(Duration::from_millis(200));
            r1.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
        .kind_backoff(
            "slow",
            Backoff {
                base: Duration::from_secs(3600),
                max: Duration::from_secs(3600),
            },
        )
        .timeout("slow", Duration::from_millis(300))
        .raw_handler("quick", move |_: &JobContext, _: &[u8]| {
            track(&r2, &m2);
            r2.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
        .start()
        .unwrap();
    let report = wait_for(&worker, Duration::from_secs(10), |r| {
        r.completed >= 1 && r.timed_out >= 1
    });
    worker.shutdown(Duration::from_secs(5));
    assert!(
        saw_flag.load(Ordering::SeqCst),
        "the handler saw should_stop at its timeout"
    );
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "one thread: never two handlers at once"
    );
    assert_eq!(report.timed_out, 1, "{report:?}");
    let job = jobs::get(&mut conn, slow).unwrap().unwrap();
    assert_eq!(
        job.state,
        JobState::Waiting,
        "failed and waiting for its retry"
    );
    assert!(job.last_error.unwrap().contains("timed out"));
    assert_eq!(
        jobs::get(&mut conn, quick).unwrap().unwrap().state,
        JobState::Completed
    );
}

fn a_cancelled_job_raises_the_flag_at_the_next_heartbeat(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = pool(&db);
    let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("cx", "k", vec![]))
        .unwrap()
        .id;
    let started = Arc::new(AtomicBool::new(false));
    let flagged: Arc<Mutex<Option<Clock>>> = Arc::default();
    let (s, f) = (started.clone(), flagged.clone());
    let ttl = Duration::from_millis(600);
    let worker = Worker::builder(pool.clone())
        .queue("cx")
        .threads(1)
        .claim_ttl(ttl)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            s.store(true, Ordering::SeqCst);
            poll_until(Duration::from_secs(10), Duration::from_millis(5), || {
                ctx.should_stop().then_some(())
            });
            *f.lock().unwrap() = ctx.should_stop().then(Clock::now);
            Ok(())
        })
        .start()
        .unwrap();
    while !started.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let cancelled_at = Clock::now();
    assert!(jobs::cancel(&mut pool.get().unwrap(), id).unwrap());
    let report = wait_for(&worker, Duration::from_secs(10), |r| r.cancelled == 1);
    worker.shutdown(Duration::from_secs(1));
    assert_eq!(report.cancelled, 1, "{report:?}");
    let seen = flagged
        .lock()
        .unwrap()
        .expect("the handler saw should_stop")
        - cancelled_at;
    // Heartbeats every ttl/3 = 200 ms; 10x margin.
    assert!(seen < ttl / 3 * 10, "{seen:?}");
    assert_eq!(
        jobs::get(&mut pool.get().unwrap(), id)
            .unwrap()
            .unwrap()
            .state,
        JobState::Cancelled
    );
}

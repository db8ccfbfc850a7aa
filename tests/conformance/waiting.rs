//! Waiting for a job to end (`jobs::wait`, `jobs::enqueue_and_wait`): every waiter gets its
//! job's true outcome once (completed with its result, dead with its error, cancelled), none
//! returns before its job ended or hangs past its timeout, and waiters hold no connection
//! while they sleep (hundreds of them beside a worker, on a pool of six). A workflow's wait
//! (`jobs::wait_workflow`) ends only once every job of it, callbacks included, has ended.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tenure::jobs::{self, JobResult, JobState, NewJob, Retry, Workflow};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Error};

use crate::common::{TestDb, conformance};

conformance!(
    each_waiter_gets_its_jobs_outcome_completed_dead_or_cancelled,
    a_wait_ends_at_its_timeout_with_the_jobs_state_and_changes_nothing,
    no_such_job_and_bad_timeouts_are_typed_errors_that_write_nothing,
    a_completion_committed_after_its_wake_up_is_seen,
    hundreds_of_waiters_hold_no_connection_while_they_sleep,
    a_workflow_wait_ends_only_when_every_job_and_callback_ended,
    a_workflow_wait_times_out_with_its_unfinished_count_and_refuses_bad_input,
);

const LONG: Duration = Duration::from_secs(120);

fn each_waiter_gets_its_jobs_outcome_completed_dead_or_cancelled(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let mut conn = db.connect();
    const ROUNDS: usize = 20;
    for round in 0..ROUNDS {
        let ids: Vec<i64> = (0..3)
            .map(|_| {
                let job = NewJob::new("w", "k", vec![]).max_attempts(1);
                jobs::enqueue(&mut conn, &job).unwrap().id
            })
            .collect();
        // Three waiters per job, started before the jobs end.
        let start = Arc::new(Barrier::new(ids.len() * 3 + 1));
        let waiters: Vec<_> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n(id, 3))
            .map(|id| {
                let (pool, start) = (pool.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    jobs::wait(&pool, id, LONG)
                })
            })
            .collect();
        start.wait();
        // On another connection: the first completes with a result, the second dies, the
        // third is cancelled while it runs (its run then ends completing or failing).
        let claimed = jobs::claim(&mut conn, "w", 3, Duration::from_secs(60)).unwrap();
        assert_eq!(claimed.len(), 3);
        let by_id = |id: i64| claimed.iter().find(|job| job.id == id).unwrap().claim();
        let result = JobResult::json(&round).unwrap();
        jobs::complete_with_result(&mut conn, by_id(ids[0]), &result).unwrap();
        jobs::fail(&mut conn, by_id(ids[1]), "broken", Retry::Never).unwrap();
        assert!(jobs::cancel(&mut conn, ids[2]).unwrap());
        if round % 2 == 1 {
            jobs::complete(&mut conn, &[by_id(ids[2])]).unwrap();
        } else {
            jobs::fail(&mut conn, by_id(ids[2]), "stopped", Retry::Never).unwrap();
        }
        for (n, waiter) in waiters.into_iter().enumerate() {
            let ended = waiter.join().unwrap().unwrap();
            let id = ids[n / 3];
            assert_eq!(ended.job.id, id);
            match n / 3 {
                0 => {
                    assert_eq!(ended.job.state, JobState::Completed);
                    assert_eq!(ended.result.unwrap().decode::<usize>().unwrap(), round);
                }
                1 => {
                    assert_eq!(ended.job.state, JobState::Dead);
                    assert_eq!(ended.job.last_error.as_deref(), Some("broken"));
                    assert!(ended.result.is_none());
                }
                _ => assert_eq!(ended.job.state, JobState::Cancelled, "{ended:?}"),
            }
        }
    }
}

fn a_wait_ends_at_its_timeout_with_the_jobs_state_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    let waiting = jobs::enqueue(&mut conn, &NewJob::new("t", "k", vec![]))
        .unwrap()
        .id;
    let running = jobs::enqueue(&mut conn, &NewJob::new("t", "k", vec![]))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "t", 1, Duration::from_secs(60)).unwrap();
    assert_eq!(
        claimed[0].id, waiting,
        "the first enqueued is claimed first"
    );
    let before: Vec<_> = [waiting, running]
        .iter()
        .map(|&id| jobs::get(&mut conn, id).unwrap().unwrap())
        .collect();
    for (id, state) in [(waiting, JobState::Running), (running, JobState::Waiting)] {
        let timeout = Duration::from_millis(300);
        let began = Instant::now();
        match jobs::wait(&pool, id, timeout) {
            Err(Error::WaitTimedOut { id: got, state: at }) => {
                assert_eq!((got, at), (id, state));
            }
            other => panic!("job {id}: {other:?}"),
        }
        // Never before the timeout; the upper bound is wide (a loaded machine).
        let took = began.elapsed();
        assert!(took >= timeout, "returned after {took:?}");
        assert!(took < timeout + Duration::from_secs(30), "took {took:?}");
    }
    let after: Vec<_> = [waiting, running]
        .iter()
        .map(|&id| jobs::get(&mut conn, id).unwrap().unwrap())
        .collect();
    assert_eq!(before, after, "waiting changed a job");
    // A zero timeout looks once.
    assert!(matches!(
        jobs::wait(&pool, running, Duration::ZERO),
        Err(Error::WaitTimedOut { .. })
    ));
}

fn no_such_job_and_bad_timeouts_are_typed_errors_that_write_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    for id in [0, -1, 987_654_321, i64::MAX] {
        match jobs::wait(&pool, id, LONG) {
            Err(Error::NoSuchJob { id: got }) => assert_eq!(got, id),
            other => panic!("job {id}: {other:?}"),
        }
    }
    let id = jobs::enqueue(&mut conn, &NewJob::new("b", "k", vec![]))
        .unwrap()
        .id;
    let err = jobs::wait(&pool, id, Duration::MAX).unwrap_err();
    assert!(err.is_invalid_input(), "{err:?}");
    let err =
        jobs::enqueue_and_wait(&pool, &NewJob::new("b", "k", vec![]), Duration::MAX).unwrap_err();
    assert!(err.is_invalid_input(), "{err:?}");
    let err = jobs::enqueue_and_wait(&pool, &NewJob::new("", "k", vec![]), LONG).unwrap_err();
    assert!(err.is_invalid_input(), "{err:?}");
    assert_eq!(
        jobs::list(&mut conn, &Default::default()).unwrap().len(),
        1,
        "a refused call enqueued a job"
    );
}

/// A completion inside a transaction wakes this process's waiters before it commits: they
/// read the job not ended yet, and must still see the commit (by their next read), not sleep
/// to their timeout.
fn a_completion_committed_after_its_wake_up_is_seen(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(3);
    let mut conn = db.connect();
    for _ in 0..5 {
        let id = jobs::enqueue(&mut conn, &NewJob::new("c", "k", vec![]))
            .unwrap()
            .id;
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || jobs::wait(&pool, id, LONG))
        };
        let job = jobs::claim(&mut conn, "c", 1, Duration::from_secs(60))
            .unwrap()
            .remove(0);
        tenure::transaction(&mut conn, |conn| -> Result<(), Error> {
            jobs::complete(conn, &[job.claim()])?;
            // The waiter is woken now and reads the job still running.
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })
        .unwrap();
        let ended = waiter.join().unwrap().unwrap();
        assert_eq!(ended.job.state, JobState::Completed);
    }
}

/// 200 waiters and a 2-thread worker share a pool of six connections (the worker needs five):
/// a waiter that held one while it slept would starve the worker, and every wait would end
/// at its timeout.
fn hundreds_of_waiters_hold_no_connection_while_they_sleep(backend: Backend) {
    const JOBS: usize = 200;
    let db = TestDb::migrated(backend);
    let pool = db.pool(6);
    let mut conn = db.connect();
    let ids: Vec<i64> = (0..JOBS)
        .map(|n| {
            let payload = n.to_string().into_bytes();
            jobs::enqueue(&mut conn, &NewJob::new("many", "echo", payload))
                .unwrap()
                .id
        })
        .collect();
    let waiters: Vec<_> = ids
        .iter()
        .map(|&id| {
            let pool = pool.clone();
            std::thread::spawn(move || jobs::wait(&pool, id, LONG))
        })
        .collect();
    let worker = Worker::builder(pool.clone())
        .queue("many")
        .threads(2)
        .raw_handler("echo", |ctx: &JobContext, payload: &[u8]| {
            let n: usize = std::str::from_utf8(payload).unwrap().parse().unwrap();
            if n % 10 == 9 {
                return Err(JobError::dead(format!("no {n}")));
            }
            ctx.set_result(JobResult::json(&n).unwrap());
            Ok(())
        })
        .start()
        .unwrap();
    for (n, waiter) in waiters.into_iter().enumerate() {
        let ended = waiter.join().unwrap().unwrap();
        assert_eq!(ended.job.id, ids[n]);
        if n % 10 == 9 {
            assert_eq!(ended.job.state, JobState::Dead, "{ended:?}");
            assert_eq!(ended.job.last_error.as_deref(), Some(&*format!("no {n}")));
        } else {
            assert_eq!(ended.job.state, JobState::Completed, "{ended:?}");
            assert_eq!(ended.result.unwrap().decode::<usize>().unwrap(), n);
        }
    }
    worker.shutdown(Duration::from_secs(10));
}

/// A diamond (a, then b and c, then d) with success and failure callbacks, run by hand one
/// job at a time while three waiters wait: none returns while any job (callbacks included)
/// has not ended, and each gets the final counts. Even rounds succeed; odd rounds kill `b`,
/// so `d` and the success callback are cancelled and the failure callback runs.
fn a_workflow_wait_ends_only_when_every_job_and_callback_ended(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let mut conn = db.connect();
    for round in 0..10 {
        let queue = format!("wf{round}");
        let mut flow = Workflow::new("diamond");
        let job = |kind: &str| NewJob::new(&*queue, kind, vec![]).max_attempts(1);
        let a = flow.add(job("a"));
        let b = flow.add_after(&[a], job("b"));
        let c = flow.add_after(&[a], job("c"));
        flow.add_after(&[b, c], job("d"));
        flow.on_success(job("ok"));
        flow.on_failure(job("failed"));
        let id = jobs::enqueue_workflow(&mut conn, &flow).unwrap().id;
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || jobs::wait_workflow(&pool, id, LONG))
            })
            .collect();
        let fails = round % 2 == 1;
        loop {
            let claimed = jobs::claim(&mut conn, &queue, 1, Duration::from_secs(60)).unwrap();
            let Some(job) = claimed.into_iter().next() else {
                break;
            };
            // One job at a time: whatever runs now, no waiter may have returned.
            std::thread::sleep(Duration::from_millis(30));
            for waiter in &waiters {
                assert!(
                    !waiter.is_finished(),
                    "a wait returned while {} ran",
                    job.kind
                );
            }
            if fails && job.kind == "b" {
                jobs::fail(&mut conn, job.claim(), "b broke", Retry::Never).unwrap();
            } else {
                jobs::complete(&mut conn, &[job.claim()]).unwrap();
            }
        }
        for waiter in waiters {
            let status = waiter.join().unwrap().unwrap();
            assert_eq!(status.counts.unfinished(), 0, "{status:?}");
            let (ok, failed) = (status.on_success.unwrap().1, status.on_failure.unwrap().1);
            if fails {
                // a, c completed; b dead; d cancelled.
                assert_eq!(
                    (status.counts.completed, status.counts.dead),
                    (2, 1),
                    "{status:?}"
                );
                assert_eq!(status.counts.cancelled, 1, "{status:?}");
                assert_eq!((ok, failed), (JobState::Cancelled, JobState::Completed));
            } else {
                assert_eq!(status.counts.completed, 4, "{status:?}");
                assert_eq!((ok, failed), (JobState::Completed, JobState::Cancelled));
            }
        }
    }
}

fn a_workflow_wait_times_out_with_its_unfinished_count_and_refuses_bad_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    let mut flow = Workflow::new("pair");
    let first = flow.add(NewJob::new("p", "a", vec![]));
    flow.add_after(&[first], NewJob::new("p", "b", vec![]));
    flow.on_finish(NewJob::new("p", "done", vec![]));
    let id = jobs::enqueue_workflow(&mut conn, &flow).unwrap().id;
    let before = jobs::workflow_jobs(&mut conn, id).unwrap();
    let timeout = Duration::from_millis(300);
    let began = Instant::now();
    match jobs::wait_workflow(&pool, id, timeout) {
        Err(Error::WorkflowWaitTimedOut {
            id: got,
            unfinished,
        }) => {
            assert_eq!((got, unfinished), (id, 3));
        }
        other => panic!("{other:?}"),
    }
    let took = began.elapsed();
    assert!(took >= timeout, "returned after {took:?}");
    assert!(took < timeout + Duration::from_secs(30), "took {took:?}");
    assert_eq!(
        jobs::workflow_jobs(&mut conn, id).unwrap(),
        before,
        "waiting changed a job"
    );
    for missing in [0, -1, id + 1_000_000, i64::MAX] {
        match jobs::wait_workflow(&pool, missing, LONG) {
            Err(Error::NoSuchWorkflow { id: got }) => assert_eq!(got, missing),
            other => panic!("workflow {missing}: {other:?}"),
        }
    }
    let err = jobs::wait_workflow(&pool, id, Duration::MAX).unwrap_err();
    assert!(err.is_invalid_input(), "{err:?}");
}

//! Queue operations: cancel, retry, pause, stats, the test helper, bad input; deduplication,
//! retention and error history in files of their own.

mod dedup;
mod history;
pub(crate) mod retention;

use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use tenure::jobs::{self, Finished, JobState, NewJob, Outcome, Retention, Retry};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Error};

use crate::common::{TestDb, conformance, count};

conformance!(
    cancel_waiting_and_running_jobs,
    retry_dead_jobs,
    paused_queues_are_skipped,
    stats_count_every_state,
    the_test_helper_runs_due_jobs_on_the_calling_thread,
    bad_input_is_refused_and_writes_nothing,
);

const TTL: Duration = Duration::from_secs(60);

fn cancel_waiting_and_running_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let waiting = jobs::enqueue(&mut conn, &NewJob::new("c", "k", vec![]).priority(1))
        .unwrap()
        .id;
    let running = jobs::enqueue(&mut conn, &NewJob::new("c", "k", vec![]))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "c", 1, TTL).unwrap().remove(0);
    assert_eq!(job.id, running);
    assert!(jobs::cancel(&mut conn, waiting).unwrap());
    assert!(
        !jobs::cancel(&mut conn, waiting).unwrap(),
        "already cancelled"
    );
    assert!(jobs::claim(&mut conn, "c", 10, TTL).unwrap().is_empty());
    assert!(jobs::cancel(&mut conn, running).unwrap());
    // The worker learns it at its next heartbeat, and its completion is refused.
    assert_eq!(
        jobs::renew(&mut conn, &[job.claim()], TTL).unwrap(),
        vec![Outcome::Cancelled]
    );
    assert_eq!(
        jobs::complete(&mut conn, &[job.claim()]).unwrap(),
        vec![Outcome::Cancelled]
    );
    assert_eq!(
        jobs::get(&mut conn, running).unwrap().unwrap().state,
        JobState::Cancelled
    );
    assert!(!jobs::cancel(&mut conn, 999_999).unwrap());
}

fn retry_dead_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut dead = Vec::new();
    for kind in ["a", "a", "b"] {
        let id = jobs::enqueue(&mut conn, &NewJob::new("rd", kind, vec![]))
            .unwrap()
            .id;
        let job = jobs::claim(&mut conn, "rd", 1, TTL).unwrap().remove(0);
        jobs::fail(&mut conn, job.claim(), "broken", Retry::Never).unwrap();
        dead.push(id);
    }
    assert!(jobs::retry_dead(&mut conn, dead[2]).unwrap());
    assert!(
        !jobs::retry_dead(&mut conn, dead[2]).unwrap(),
        "no longer dead"
    );
    let again = jobs::get(&mut conn, dead[2]).unwrap().unwrap();
    assert_eq!((again.state, again.attempt), (JobState::Waiting, 0));
    assert_eq!(jobs::retry_dead_of_kind(&mut conn, "rd", "a").unwrap(), 2);
    assert_eq!(jobs::claim(&mut conn, "rd", 10, TTL).unwrap().len(), 3);
    // A dead job whose key a live job now has cannot come back: a typed error, nothing changes.
    let first = jobs::enqueue(&mut conn, &NewJob::new("rk", "k", vec![]).dedup_key("x"))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "rk", 1, TTL).unwrap().remove(0);
    jobs::fail(&mut conn, job.claim(), "broken", Retry::Never).unwrap();
    jobs::enqueue(&mut conn, &NewJob::new("rk", "k", vec![]).dedup_key("x")).unwrap();
    let err = jobs::retry_dead(&mut conn, first).unwrap_err();
    assert!(err.is_invalid_input(), "{err:?}");
    assert_eq!(
        jobs::get(&mut conn, first).unwrap().unwrap().state,
        JobState::Dead
    );
}

fn paused_queues_are_skipped(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::pause(&mut conn, "p").unwrap();
    jobs::pause(&mut conn, "p").unwrap();
    assert!(jobs::is_paused(&mut conn, "p").unwrap());
    assert!(!jobs::is_paused(&mut conn, "P").unwrap());
    jobs::enqueue(&mut conn, &NewJob::new("p", "k", vec![])).unwrap();
    jobs::enqueue(&mut conn, &NewJob::new("other", "k", vec![])).unwrap();
    assert!(
        jobs::claim(&mut conn, "p", 10, TTL).unwrap().is_empty(),
        "a paused queue is skipped"
    );
    assert_eq!(jobs::claim(&mut conn, "other", 10, TTL).unwrap().len(), 1);
    jobs::resume(&mut conn, "p").unwrap();
    jobs::resume(&mut conn, "p").unwrap();
    assert_eq!(jobs::claim(&mut conn, "p", 10, TTL).unwrap().len(), 1);
}

fn stats_count_every_state(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let ids: Vec<i64> = jobs::enqueue_many(
        &mut conn,
        &(0..6)
            .map(|_| NewJob::new("s", "k", vec![]))
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .iter()
    .map(|e| e.id)
    .collect();
    jobs::enqueue(
        &mut conn,
        &NewJob::new("t", "k", vec![]).delay(Duration::from_secs(3600)),
    )
    .unwrap();
    let claimed = jobs::claim(&mut conn, "s", 4, TTL).unwrap();
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    jobs::fail(&mut conn, claimed[1].claim(), "x", Retry::Never).unwrap();
    jobs::cancel(&mut conn, ids[5]).unwrap();
    jobs::pause(&mut conn, "paused-empty").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let stats = jobs::stats(&mut conn).unwrap();
    let s = stats.queues.iter().find(|q| q.queue == "s").unwrap();
    assert_eq!(
        (s.waiting, s.running, s.completed, s.dead, s.cancelled),
        (1, 2, 1, 1, 1),
        "{s:?}"
    );
    assert!(
        s.oldest_waiting >= chrono::Duration::milliseconds(40),
        "{s:?}"
    );
    let t = stats.queues.iter().find(|q| q.queue == "t").unwrap();
    assert_eq!(
        (t.waiting, t.oldest_waiting),
        (1, chrono::Duration::zero()),
        "not due yet: no wait"
    );
    assert!(
        stats
            .queues
            .iter()
            .any(|q| q.queue == "paused-empty" && q.paused)
    );
    assert_eq!(stats.running.len(), 2);
    assert!(
        stats
            .running
            .iter()
            .all(|r| r.claim_expires_at.is_some_and(|at| at > stats.now))
    );
}

fn the_test_helper_runs_due_jobs_on_the_calling_thread(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = pool.get().unwrap();
    jobs::enqueue(&mut conn, &NewJob::json("app", "add", &(2, 3)).unwrap()).unwrap();
    jobs::enqueue(&mut conn, &NewJob::json("app", "add", &(40, 2)).unwrap()).unwrap();
    jobs::enqueue(
        &mut conn,
        &NewJob::json("app", "add", &(0, 0)).unwrap().max_attempts(1),
    )
    .unwrap();
    jobs::enqueue(
        &mut conn,
        &NewJob::json("app", "later", &())
            .unwrap()
            .delay(Duration::from_secs(600)),
    )
    .unwrap();
    let caller = std::thread::current().id();
    let sums = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = sums.clone();
    let report = Worker::builder(pool.clone())
        .queue("app")
        .handler("add", move |_: &JobContext, (a, b): (i32, i32)| {
            assert_eq!(std::thread::current().id(), caller);
            if a + b == 0 {
                return Err(JobError::dead("nothing to add"));
            }
            seen.lock().unwrap().push(a + b);
            Ok(())
        })
        .raw_handler("later", |_: &JobContext, _: &[u8]| Ok(()))
        .drain()
        .unwrap();
    assert_eq!((report.completed, report.dead), (2, 1), "{report:?}");
    assert_eq!(*sums.lock().unwrap(), vec![5, 42]);
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'"
        ),
        1,
        "the delayed job is not due"
    );
}

fn bad_input_is_refused_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let long = "k".repeat(256);
    assert!(
        jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).dedup_key(""))
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "k", vec![]).dedup_key(long.as_str())
        )
        .unwrap_err()
        .is_invalid_input()
    );
    assert!(jobs::pause(&mut conn, "").unwrap_err().is_invalid_input());
    assert!(
        jobs::resume(&mut conn, &long)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::retry_dead_of_kind(&mut conn, "q", "")
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::prune(&mut conn, "", Finished::Completed, Retention::DeleteAll, 10)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::prune(&mut conn, "q", Finished::Completed, Retention::DeleteAll, 0)
            .unwrap_err()
            .is_invalid_input()
    );
    let absurd = Retention::KeepYoungerThan(Duration::from_secs(400 * 86400));
    assert!(
        jobs::prune(&mut conn, "q", Finished::Completed, absurd, 10)
            .unwrap_err()
            .is_invalid_input()
    );
    let refused = conn
        .transaction(|c| jobs::prune(c, "q", Finished::Dead, Retention::DeleteAll, 10))
        .unwrap_err();
    assert!(
        matches!(refused, Error::InTransaction { .. }),
        "{refused:?}"
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_queue_pauses"),
        0
    );
}

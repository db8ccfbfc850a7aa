//! `tenure::testing`: what an application's tests use, on every backend.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tenure::jobs::{self, JobArgs, JobState, NewJob};
use tenure::worker::{Event, JobContext, JobError, Worker};
use tenure::{Backend, Pool, testing};

use crate::common::{TestDb, conformance};

conformance!(
    drain_runs_follow_up_jobs_on_a_pool_of_one,
    enqueued_and_assert_enqueued_see_waiting_jobs_only,
    drain_survives_a_panicking_event_hook,
    drain_ends_when_handlers_enqueue_forever,
    a_drain_hook_may_use_a_pool_of_one,
);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Signup {
    user: String,
}

impl JobArgs for Signup {
    const KIND: &'static str = "signup";
    const QUEUE: &'static str = "users";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Welcome {
    to: String,
}

impl JobArgs for Welcome {
    const KIND: &'static str = "welcome";
    const QUEUE: &'static str = "mail";
}

/// A handler that enqueues a follow-up on the worker's own pool: the drain runs both, with
/// one connection in the pool (the drain holds none while a handler runs).
fn drain_runs_follow_up_jobs_on_a_pool_of_one(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    jobs::enqueue_job(&mut pool.get().unwrap(), &Signup { user: "ada".into() }).unwrap();
    let handler_pool = pool.clone();
    let report = testing::drain(
        Worker::builder(pool.clone())
            .register(move |_: &JobContext, signup: Signup| {
                let mut conn = handler_pool.get()?;
                jobs::enqueue_job(&mut conn, &Welcome { to: signup.user })?;
                Ok(())
            })
            .register(|_: &JobContext, welcome: Welcome| {
                if welcome.to.is_empty() {
                    return Err(JobError::dead("no recipient"));
                }
                Ok(())
            }),
    )
    .unwrap();
    assert_eq!(report.completed, 2, "{report:?}");
    assert!(
        testing::enqueued::<Welcome, _>(&mut pool.get().unwrap())
            .unwrap()
            .is_empty()
    );
}

fn enqueued_and_assert_enqueued_see_waiting_jobs_only(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool: Pool = db.pool(2);
    let mut conn = pool.get().unwrap();
    let ada = Welcome { to: "ada".into() };
    let bob = Welcome { to: "bob".into() };
    jobs::enqueue_job(&mut conn, &ada).unwrap();
    jobs::enqueue_job(&mut conn, &bob).unwrap();
    // Another kind on another queue is not a Welcome.
    jobs::enqueue_job(
        &mut conn,
        &Signup {
            user: "carol".into(),
        },
    )
    .unwrap();
    assert_eq!(
        testing::enqueued::<Welcome, _>(&mut conn).unwrap(),
        vec![ada.clone(), bob.clone()]
    );
    testing::assert_enqueued(&mut conn, &bob);
    let missing = Welcome { to: "dave".into() };
    let panic = catch_unwind(AssertUnwindSafe(|| {
        testing::assert_enqueued(&mut conn, &missing)
    }))
    .expect_err("no such job: the assertion fails");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("dave") && message.contains("bob"),
        "{message}"
    );
    // Once run, they are no longer waiting.
    drop(conn);
    Worker::builder(pool.clone())
        .register(|_: &JobContext, _: Welcome| Ok(()))
        .drain()
        .unwrap();
    let mut conn = pool.get().unwrap();
    assert!(
        testing::enqueued::<Welcome, _>(&mut conn)
            .unwrap()
            .is_empty()
    );
    assert_eq!(testing::enqueued::<Signup, _>(&mut conn).unwrap().len(), 1);
}

/// `drain` with a hook that panics: every job still runs and is recorded once.
fn drain_survives_a_panicking_event_hook(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    for _ in 0..3 {
        jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("dp", "k", vec![])).unwrap();
    }
    let drained = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Worker::builder(pool.clone())
            .queue("dp")
            .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
            .on_event(|_: &Event| panic!("a hook with a bug"))
            .drain()
    }));
    let report = drained
        .expect("drain must not unwind out from a hook's panic")
        .unwrap();
    assert_eq!(report.completed, 3, "{report:?}");
}

/// A handler that enqueues another job every run: drain runs jobs handlers enqueue, and must
/// also end. The handler stops enqueueing after a safety cap so the test itself ends; the
/// drain should have stopped (an error, or a report) well before.
fn drain_ends_when_handlers_enqueue_forever(backend: Backend) {
    const CAP: usize = 2000;
    const LIMIT: usize = 300;
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("ef", "k", vec![])).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (counter, handler_pool) = (runs.clone(), pool.clone());
    let drained = Worker::builder(pool.clone())
        .queue("ef")
        .drain_limit(LIMIT)
        .raw_handler("k", move |_: &JobContext, _: &[u8]| {
            if counter.fetch_add(1, Ordering::SeqCst) < CAP {
                jobs::enqueue(&mut handler_pool.get()?, &NewJob::new("ef", "k", vec![]))?;
            }
            Ok(())
        })
        .drain();
    let runs = runs.load(Ordering::SeqCst);
    assert_eq!(runs, LIMIT, "the drain stops at its limit: {drained:?}");
    let err = drained.expect_err("a drain stopped by its limit says so");
    assert!(
        matches!(err, tenure::Error::Timeout { .. }) && err.to_string().contains("drain_limit"),
        "{err}"
    );
    // The job it found still due was given back, unstarted, no attempt used.
    let mut conn = pool.get().unwrap();
    let waiting = jobs::list(
        &mut conn,
        &jobs::JobFilter {
            queue: Some("ef".into()),
            state: Some(JobState::Waiting),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0].attempt, 0);
}

/// `drain` on a pool of one: a hook that reads the database when a run is recorded (a
/// test checking what it sees) gets a connection too, as handlers do.
fn a_drain_hook_may_use_a_pool_of_one(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = tenure::Pool::options()
        .max_size(1)
        .connection_timeout(Duration::from_secs(3))
        .open(db.url())
        .unwrap();
    let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("hp", "k", vec![]))
        .unwrap()
        .id;
    let states: Arc<Mutex<Vec<String>>> = Arc::default();
    let (sink, hook_pool) = (states.clone(), pool.clone());
    let report = Worker::builder(pool.clone())
        .queue("hp")
        .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
        .on_event(move |event: &Event| {
            if let Event::Run(run) = event {
                let seen = match hook_pool.get() {
                    Ok(mut conn) => format!(
                        "{:?}",
                        jobs::get(&mut conn, run.id).map(|j| j.map(|j| j.state))
                    ),
                    Err(e) => format!("no connection: {e}"),
                };
                sink.lock().unwrap().push(seen);
            }
        })
        .drain()
        .unwrap();
    assert_eq!(report.completed, 1);
    assert_eq!(
        *states.lock().unwrap(),
        vec![format!(
            "{:?}",
            Ok::<_, tenure::Error>(Some(JobState::Completed))
        )],
        "job {id}"
    );
}

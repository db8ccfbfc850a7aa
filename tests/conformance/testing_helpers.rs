//! `tenure::testing`: what an application's tests use, on every backend.

use std::panic::{AssertUnwindSafe, catch_unwind};

use serde::{Deserialize, Serialize};
use tenure::jobs::{self, JobArgs};
use tenure::testing;
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Pool};

use crate::common::{TestDb, conformance};

conformance!(
    drain_runs_follow_up_jobs_on_a_pool_of_one,
    enqueued_and_assert_enqueued_see_waiting_jobs_only,
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

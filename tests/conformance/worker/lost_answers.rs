//! A claim that committed while its answer was lost (the connection died at its commit, as in
//! a failover: `clusters::patroni`) leaves a job recorded as the worker's that the worker never
//! heard of. After an error on its connection the worker compares the database's record of its
//! claims with what it holds and gives back the difference, so the job runs again within
//! seconds instead of after its claim's ttl.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, Worker};
use tenure::{Backend, Pool};

use crate::common::proxy::TestProxy;
use crate::common::{TestDb, on_servers};

on_servers!(a_job_whose_claim_answer_was_lost_runs_again_within_seconds);

/// The test claims a job (claim ttl 60 s) and records it as the worker's, as if the worker's
/// own claim had committed unheard; then every connection through the proxy is cut. The
/// worker's next statement fails, and once it is connected again it gives the job back and
/// runs it: within 20 s of the cut (without it: 60 s, when the claim lapses).
fn a_job_whose_claim_answer_was_lost_runs_again_within_seconds(backend: Backend) {
    crate::common::show_warnings();
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let lost = jobs::enqueue(&mut conn, &NewJob::new("lost-answer", "k", vec![]))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "lost-answer", 1, Duration::from_secs(60)).unwrap();
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![lost]);

    let proxy = TestProxy::start(db.url(), backend);
    let pool = Pool::options().max_size(8).open(&proxy.url).unwrap();
    let runs: Arc<Mutex<Vec<(i64, Instant)>>> = Arc::default();
    let seen = runs.clone();
    let worker = Worker::builder(pool)
        .queue("lost-answer")
        .threads(2)
        .claim_ttl(Duration::from_secs(60))
        .poll_interval(Duration::from_millis(100))
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            seen.lock().unwrap().push((ctx.id, Instant::now()));
            Ok(())
        })
        .start()
        .unwrap();
    // A first job run: the worker is registered and its claimer holds a connection (the
    // one the cut breaks under its next claim).
    let probe = jobs::enqueue(&mut conn, &NewJob::new("lost-answer", "k", vec![]))
        .unwrap()
        .id;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !runs.lock().unwrap().iter().any(|(id, _)| *id == probe) {
        assert!(
            Instant::now() < deadline,
            "the worker never ran its first job"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    conn.batch_execute(&format!(
        "UPDATE tenure_jobs SET claimed_by = (SELECT MAX(id) FROM tenure_workers) WHERE id = {lost}"
    ))
    .unwrap();

    proxy.kill_all();
    let cut = Instant::now();
    while !runs.lock().unwrap().iter().any(|(id, _)| *id == lost) {
        assert!(
            cut.elapsed() < Duration::from_secs(20),
            "{backend}: the job whose claim answer was lost did not run within 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    worker.shutdown(Duration::from_secs(5));
    assert_eq!(
        jobs::get(&mut conn, lost).unwrap().unwrap().attempt,
        1,
        "the given-back claim used no attempt"
    );
}

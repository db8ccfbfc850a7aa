//! A worker SIGKILLed after it parked a job: the parked job holds no claim, so neither the
//! worker's death nor the rescue of its claims touches it; it stays parked, and its token
//! completes it later.

use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob, ParkToken, ParkedOutcome};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Pool};

use crate::child::spawn;
use crate::common::{TestDb, conformance, count, wait_until};

conformance!(a_worker_killed_after_parking_leaves_the_job_parked_for_its_token);

const LONG: Duration = Duration::from_secs(120);

/// A worker process of this scenario: kind `park` parks its job for an hour and reports the
/// token (`TENURE token ...`). Runs until killed.
pub fn parking_worker(url: &str) {
    let pool = Pool::options().max_size(8).open(url).expect("pool");
    let _worker = Worker::builder(pool)
        .queue("parking")
        .threads(1)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("park", |ctx: &JobContext, _: &[u8]| {
            let token = ctx.park(Duration::from_secs(3600))?;
            println!("TENURE token {}", token.expose_secret());
            Err(JobError::parked())
        })
        .start()
        .expect("start the worker");
    println!("TENURE started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn a_worker_killed_after_parking_leaves_the_job_parked_for_its_token(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = NewJob::new("parking", "park", vec![]).max_attempts(1);
    let id = jobs::enqueue(&mut conn, &job).unwrap().id;
    let mut child = spawn("parking-worker", &[db.url()]);
    assert_eq!(child.next_report().as_deref(), Some("started"));
    let report = child.next_report().expect("the child's token");
    let token: ParkToken = report
        .strip_prefix("token ")
        .expect("a token line")
        .parse()
        .unwrap();
    assert_eq!(token.job_id(), id);
    wait_until("the job parked", LONG, || {
        (jobs::get(&mut conn, id).unwrap().unwrap().state == JobState::Parked).then_some(())
    });
    child.signal("KILL");
    let _ = child.child.wait();
    // The dead worker is recognised (its lock ended with it) and its claims rescued: the
    // parked job is not among them.
    wait_until("the dead worker taken for dead", LONG, || {
        let rescued = jobs::rescue(&mut conn, 100).unwrap();
        assert!(!rescued.requeued.contains(&id) && !rescued.dead.contains(&id));
        (count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_workers") == 0).then_some(())
    });
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(
        (job.state, job.claim_expires_at, job.lapses),
        (JobState::Parked, None, 0)
    );
    assert_eq!(
        jobs::complete_parked(&mut conn, &token, None).unwrap(),
        ParkedOutcome::Applied
    );
    assert_eq!(
        jobs::get(&mut conn, id).unwrap().unwrap().state,
        JobState::Completed
    );
}

//! A worker SIGKILLed after it parked a job: the parked job holds no claim, so neither the
//! worker's death nor the rescue of its claims touches it; it stays parked, and its token
//! completes it later. A worker SIGKILLed between `ctx.park` and recording the park: the
//! rescue of its claims parks the jobs whose runs parked (their tokens were handed out),
//! applying an answer that came before the kill.

use std::time::Duration;

use tenure::jobs::{self, JobResult, JobState, NewJob, ParkRefusal, ParkToken, ParkedOutcome};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Pool};

use crate::child::spawn;
use crate::common::{TestDb, conformance, count, wait_until};

conformance!(
    a_worker_killed_after_parking_leaves_the_job_parked_for_its_token,
    a_worker_killed_between_park_and_its_record_leaves_the_jobs_parked_for_their_tokens,
);

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

/// A worker process of this scenario: kind `park` parks its job for an hour, reports the
/// token (`TENURE token ...`) and never returns: the kill comes between `ctx.park` and the
/// worker's record of the park.
pub fn park_and_hang_worker(url: &str) {
    let pool = Pool::options().max_size(8).open(url).expect("pool");
    let _worker = Worker::builder(pool)
        .queue("hanging")
        .threads(4)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("park", |ctx: &JobContext, _: &[u8]| {
            let token = ctx.park(Duration::from_secs(3600))?;
            println!("TENURE token {}", token.expose_secret());
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        })
        .start()
        .expect("start the worker");
    println!("TENURE started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Rounds of four jobs, each run parked (its token out) and hung; two answered before the
/// kill (a completion with a result and a resume: accepted), two not. After the SIGKILL and
/// the rescue of the dead worker's claims: the completed one is completed with its result,
/// the resumed one waits to run again, the other two are parked and their tokens complete
/// them; every used token is refused after. Counted.
fn a_worker_killed_between_park_and_its_record_leaves_the_jobs_parked_for_their_tokens(
    backend: Backend,
) {
    const ROUNDS: usize = 2;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut parked_then_applied = 0;
    for round in 0..ROUNDS {
        let mut ids = Vec::new();
        for _ in 0..4 {
            let job = NewJob::new("hanging", "park", vec![]).max_attempts(1);
            ids.push(jobs::enqueue(&mut conn, &job).unwrap().id);
        }
        let mut child = spawn("park-and-hang-worker", &[db.url()]);
        assert_eq!(child.next_report().as_deref(), Some("started"));
        let mut tokens: Vec<ParkToken> = (0..4)
            .map(|_| {
                let report = child.next_report().expect("the child's token");
                report
                    .strip_prefix("token ")
                    .expect("a token line")
                    .parse()
                    .unwrap()
            })
            .collect();
        tokens.sort_by_key(ParkToken::job_id);
        assert_eq!(
            tokens.iter().map(ParkToken::job_id).collect::<Vec<_>>(),
            ids
        );
        let result = JobResult::json(&round).unwrap();
        assert_eq!(
            jobs::complete_parked(&mut conn, &tokens[0], Some(&result)).unwrap(),
            ParkedOutcome::Accepted
        );
        assert_eq!(
            jobs::resume_parked(&mut conn, &tokens[1], Some(&result)).unwrap(),
            ParkedOutcome::Accepted
        );
        child.signal("KILL");
        let _ = child.child.wait();
        wait_until("the dead worker's claims taken back", LONG, || {
            jobs::rescue(&mut conn, 100).unwrap();
            ids.iter()
                .all(|id| jobs::get(&mut conn, *id).unwrap().unwrap().state != JobState::Running)
                .then_some(())
        });
        let state =
            |conn: &mut tenure::AnyConnection, id: i64| jobs::get(conn, id).unwrap().unwrap().state;
        assert_eq!(
            state(&mut conn, ids[0]),
            JobState::Completed,
            "round {round}"
        );
        assert_eq!(jobs::result(&mut conn, ids[0]).unwrap(), Some(result));
        assert_eq!(state(&mut conn, ids[1]), JobState::Waiting, "round {round}");
        for i in 2..4 {
            assert_eq!(state(&mut conn, ids[i]), JobState::Parked, "round {round}");
            assert_eq!(
                jobs::complete_parked(&mut conn, &tokens[i], None).unwrap(),
                ParkedOutcome::Applied
            );
            assert_eq!(state(&mut conn, ids[i]), JobState::Completed);
            parked_then_applied += 1;
        }
        for token in &tokens {
            let refused = jobs::complete_parked(&mut conn, token, None).unwrap_err();
            assert!(
                matches!(refused, tenure::Error::ParkTokenRefused(ParkRefusal::Used)),
                "{refused:?}"
            );
        }
        // The resumed job is not run again here (no worker): cancel it for the next round.
        jobs::cancel(&mut conn, ids[1]).unwrap();
    }
    assert_eq!(parked_then_applied, 2 * ROUNDS);
}

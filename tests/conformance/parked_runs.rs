//! How a run that parked ends: once `JobContext::park` returned a token, the job waits for
//! that token whatever becomes of the run's claim (lapsed and rescued, shutdown past its
//! grace, past its kind's timeout), an answer that came while the handler ran is applied
//! once, a second park of one run is refused and keeps the first token, and an answer a run
//! dropped (it ended another way) is never read as a resume by a later run.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::jobs::{self, JobResult, JobState, NewJob, ParkRefusal, ParkToken, ParkedOutcome};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, conformance, job_state, wait_until};

conformance!(
    a_run_that_parked_and_lost_its_claim_leaves_the_job_parked_for_its_token,
    a_run_that_parked_and_returned_past_the_shutdown_grace_stays_parked,
    a_run_that_parked_and_returned_past_its_timeout_stays_parked,
    a_second_park_in_one_run_is_refused_and_the_first_token_answers,
    an_answer_a_run_dropped_is_never_read_as_a_resume,
    runs_that_parked_and_have_not_returned_do_not_hold_back_other_expiries,
);

const LONG: Duration = Duration::from_secs(120);
const HOUR: Duration = Duration::from_secs(3600);

fn refusal(result: tenure::Result<ParkedOutcome>) -> ParkRefusal {
    match result {
        Err(Error::ParkTokenRefused(why)) => why,
        other => panic!("expected a refused token, got {other:?}"),
    }
}

fn wait_while_running(conn: &mut AnyConnection, id: i64) -> JobState {
    wait_until(&format!("job {id} no longer running"), LONG, || {
        let state = job_state(conn, id);
        (state != JobState::Running).then_some(state)
    })
}

/// Each round: a worker whose handler parks, hands out its token and then hangs (until the
/// round ends) is shut down with no grace; its claim is left to lapse and a rescue takes it
/// back. The job must be parked for the token then: even rounds answer it before the rescue
/// (accepted, then applied by the rescue: completed with the result), odd rounds after
/// (applied at once). Counted.
fn a_run_that_parked_and_lost_its_claim_leaves_the_job_parked_for_its_token(backend: Backend) {
    const ROUNDS: usize = 4;
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (mut applied, mut accepted_then_applied) = (0, 0);
    for round in 0..ROUNDS {
        let (tokens, received) = channel::<ParkToken>();
        let (release, hang) = channel::<()>();
        let (tokens, hang) = (Mutex::new(tokens), Mutex::new(hang));
        let worker = Worker::builder(pool.clone())
            .queue("lapse")
            .claim_ttl(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(20))
            .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
                let token = ctx.park(HOUR)?;
                tokens.lock().unwrap().send(token).unwrap();
                let _ = hang.lock().unwrap().recv_timeout(LONG);
                Err(JobError::parked())
            })
            .start()
            .unwrap();
        let job = NewJob::new("lapse", "park", b"0".to_vec()).max_attempts(1);
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        let token = received.recv_timeout(LONG).unwrap();
        let result = JobResult::json(&round).unwrap();
        if round % 2 == 0 {
            assert_eq!(
                jobs::complete_parked(&mut conn, &token, Some(&result)).unwrap(),
                ParkedOutcome::Accepted
            );
        }
        // Past its grace the handler does not return: its claim lapses, unrenewed.
        worker.shutdown(Duration::ZERO);
        let state = wait_until("the lapsed claim rescued", LONG, || {
            jobs::rescue(&mut conn, 100).unwrap();
            let state = job_state(&mut conn, id);
            (state != JobState::Running).then_some(state)
        });
        if round % 2 == 0 {
            assert_eq!(state, JobState::Completed, "round {round}");
            assert_eq!(jobs::result(&mut conn, id).unwrap(), Some(result));
            assert_eq!(
                refusal(jobs::complete_parked(&mut conn, &token, None)),
                ParkRefusal::Used
            );
            accepted_then_applied += 1;
        } else {
            assert_eq!(state, JobState::Parked, "round {round}");
            let job = jobs::get(&mut conn, id).unwrap().unwrap();
            assert_eq!((job.claim_expires_at, job.lapses), (None, 0));
            assert_eq!(
                jobs::complete_parked(&mut conn, &token, Some(&result)).unwrap(),
                ParkedOutcome::Applied
            );
            assert_eq!(job_state(&mut conn, id), JobState::Completed);
            applied += 1;
        }
        // The hung handler returns now, late: its record changes nothing.
        let _ = release.send(());
        assert_eq!(job_state(&mut conn, id), JobState::Completed);
    }
    assert_eq!((applied, accepted_then_applied), (ROUNDS / 2, ROUNDS / 2));
}

/// A handler that parks, hands out its token, waits until it is asked to stop, then returns
/// `JobError::parked()`: asked by a shutdown past its grace, it chose to park, so the job
/// is parked (not given back) and its token answers it. Rounds alternate an answer before
/// the shutdown (accepted, applied when the run is recorded) and after.
fn a_run_that_parked_and_returned_past_the_shutdown_grace_stays_parked(backend: Backend) {
    const ROUNDS: usize = 4;
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    for round in 0..ROUNDS {
        let (tokens, received) = channel::<ParkToken>();
        let tokens = Mutex::new(tokens);
        let worker = Worker::builder(pool.clone())
            .queue("grace")
            .poll_interval(Duration::from_millis(20))
            .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
                let token = ctx.park(HOUR)?;
                tokens.lock().unwrap().send(token).unwrap();
                while !ctx.should_stop() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(JobError::parked())
            })
            .start()
            .unwrap();
        let job = NewJob::new("grace", "park", b"0".to_vec()).max_attempts(1);
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        let token = received.recv_timeout(LONG).unwrap();
        let result = JobResult::json(&round).unwrap();
        let early = round % 2 == 0;
        if early {
            assert_eq!(
                jobs::complete_parked(&mut conn, &token, Some(&result)).unwrap(),
                ParkedOutcome::Accepted
            );
        }
        let report = worker.shutdown(Duration::ZERO);
        assert_eq!(report.parked, 1, "round {round}: {report:?}");
        let state = wait_while_running(&mut conn, id);
        if early {
            assert_eq!(state, JobState::Completed, "round {round}");
            assert_eq!(jobs::result(&mut conn, id).unwrap(), Some(result));
        } else {
            assert_eq!(state, JobState::Parked, "round {round}");
            assert_eq!(
                jobs::complete_parked(&mut conn, &token, Some(&result)).unwrap(),
                ParkedOutcome::Applied
            );
            assert_eq!(job_state(&mut conn, id), JobState::Completed);
        }
    }
}

/// A kind with a 50 ms timeout whose handler parks, hands out its token and returns
/// `JobError::parked()` only once asked to stop (its timeout passed): it chose to park, so
/// the job is parked, not failed, and each token completes its job. Counted.
fn a_run_that_parked_and_returned_past_its_timeout_stays_parked(backend: Backend) {
    const JOBS: usize = 6;
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (tokens, received) = channel::<ParkToken>();
    let tokens = Mutex::new(tokens);
    let worker = Worker::builder(pool.clone())
        .queue("late")
        .threads(2)
        .poll_interval(Duration::from_millis(20))
        .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
            let token = ctx.park(HOUR)?;
            tokens.lock().unwrap().send(token).unwrap();
            while !ctx.should_stop() {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(JobError::parked())
        })
        .timeout("park", Duration::from_millis(50))
        .start()
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..JOBS {
        let job = NewJob::new("late", "park", b"0".to_vec()).max_attempts(3);
        ids.push(jobs::enqueue(&mut conn, &job).unwrap().id);
    }
    let mut completed = 0;
    for _ in 0..JOBS {
        let token = received.recv_timeout(LONG).unwrap();
        let state = wait_while_running(&mut conn, token.job_id());
        assert_eq!(state, JobState::Parked, "job {}", token.job_id());
        assert_eq!(
            jobs::complete_parked(&mut conn, &token, None).unwrap(),
            ParkedOutcome::Applied
        );
        completed += 1;
    }
    let report = worker.shutdown(LONG);
    assert_eq!((completed, report.parked), (JOBS, JOBS), "{report:?}");
    for id in ids {
        assert_eq!(job_state(&mut conn, id), JobState::Completed);
    }
}

/// The handler parks, hands out its token, waits for the test to answer it (accepted), then
/// calls `park` again: refused (one park per run), and the first token's answer is applied
/// when the run parks. Counted over rounds alternating complete and resume.
fn a_second_park_in_one_run_is_refused_and_the_first_token_answers(backend: Backend) {
    const ROUNDS: usize = 6;
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (tokens, received) = channel::<ParkToken>();
    let (go, gate) = channel::<()>();
    let (seconds, second_parks) = channel::<bool>();
    let shared = Mutex::new((tokens, gate, seconds));
    let worker = Worker::builder(pool.clone())
        .queue("twice")
        .poll_interval(Duration::from_millis(20))
        .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
            if ctx.resume_value()?.is_some() {
                return Ok(());
            }
            let shared = shared.lock().unwrap();
            let token = ctx.park(HOUR)?;
            shared.0.send(token).unwrap();
            shared.1.recv_timeout(LONG).unwrap();
            let refused = matches!(ctx.park(HOUR), Err(Error::InvalidInput { .. }));
            shared.2.send(refused).unwrap();
            Err(JobError::parked())
        })
        .start()
        .unwrap();
    let mut refused = 0;
    for round in 0..ROUNDS {
        let job = NewJob::new("twice", "park", b"0".to_vec()).max_attempts(1);
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        let token = received.recv_timeout(LONG).unwrap();
        let value = JobResult::json(&round).unwrap();
        let outcome = if round % 2 == 0 {
            jobs::complete_parked(&mut conn, &token, Some(&value)).unwrap()
        } else {
            jobs::resume_parked(&mut conn, &token, Some(&value)).unwrap()
        };
        assert_eq!(outcome, ParkedOutcome::Accepted);
        go.send(()).unwrap();
        if second_parks.recv_timeout(LONG).unwrap() {
            refused += 1;
        }
        // Completed (with the result), or resumed and then completed by its next run.
        let state = wait_until(&format!("job {id} ended or parked"), LONG, || {
            let state = job_state(&mut conn, id);
            matches!(state, JobState::Completed | JobState::Parked).then_some(state)
        });
        assert_eq!(state, JobState::Completed, "round {round}");
        if round % 2 == 0 {
            assert_eq!(jobs::result(&mut conn, id).unwrap(), Some(value));
        }
    }
    worker.shutdown(LONG);
    assert_eq!(refused, ROUNDS);
}

/// The first run parks, hands out its token, waits for the test to resume it with a value
/// (accepted), then changes its mind and fails (a retry): the run's end wins, the resume is
/// dropped, and the next run reads no resume value. The token is then refused as used.
fn an_answer_a_run_dropped_is_never_read_as_a_resume(backend: Backend) {
    const ROUNDS: usize = 6;
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (tokens, received) = channel::<ParkToken>();
    let (go, gate) = channel::<()>();
    let (reads, read) = channel::<Option<JobResult>>();
    type Shared = (Sender<ParkToken>, Receiver<()>, Sender<Option<JobResult>>);
    let shared: Arc<Mutex<Shared>> = Arc::new(Mutex::new((tokens, gate, reads)));
    let worker = Worker::builder(pool.clone())
        .queue("dropped")
        .poll_interval(Duration::from_millis(20))
        .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
            let shared = shared.lock().unwrap();
            if ctx.attempt > 1 {
                shared.2.send(ctx.resume_value()?).unwrap();
                return Ok(());
            }
            let token = ctx.park(HOUR)?;
            shared.0.send(token).unwrap();
            shared.1.recv_timeout(LONG).unwrap();
            Err(JobError::retry("changed its mind"))
        })
        .kind_backoff(
            "park",
            tenure::jobs::Backoff {
                base: Duration::from_millis(1),
                max: Duration::from_millis(1),
            },
        )
        .start()
        .unwrap();
    for round in 0..ROUNDS {
        let job = NewJob::new("dropped", "park", b"0".to_vec()).max_attempts(2);
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        let token = received.recv_timeout(LONG).unwrap();
        let value = JobResult::json(&round).unwrap();
        assert_eq!(
            jobs::resume_parked(&mut conn, &token, Some(&value)).unwrap(),
            ParkedOutcome::Accepted
        );
        go.send(()).unwrap();
        assert_eq!(read.recv_timeout(LONG).unwrap(), None, "round {round}");
        let ended = jobs::wait(&pool, id, LONG).unwrap();
        assert_eq!(ended.job.state, JobState::Completed);
        assert_eq!(
            refusal(jobs::resume_parked(&mut conn, &token, None)),
            ParkRefusal::Used
        );
    }
    worker.shutdown(LONG);
}

/// A run that parked (its deadline already past) and has not returned is skipped by the
/// deadline's expiry until it does; found by the attack on parked jobs: the expiry read the
/// oldest open parks, these among them, and skipped them, so with as many such runs as a pass
/// reads (a worker reads 100) no other park ever expired. Here a pass of one: before the fix
/// it returned nothing while a parked job's deadline had passed.
fn runs_that_parked_and_have_not_returned_do_not_hold_back_other_expiries(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(6);
    let mut conn = db.connect();
    let hanging = jobs::enqueue(&mut conn, &NewJob::new("hang", "park", b"0".to_vec()))
        .unwrap()
        .id;
    let (parked, parks) = channel::<()>();
    let (release, gate) = channel::<()>();
    let shared = Mutex::new((parked, gate));
    let builder = Worker::builder(pool.clone()).queue("hang").handler(
        "park",
        move |ctx: &JobContext, _: serde_json::Value| {
            let shared = shared.lock().unwrap();
            ctx.park(Duration::ZERO)?;
            shared.0.send(()).unwrap();
            shared.1.recv_timeout(LONG).unwrap();
            Err(JobError::parked())
        },
    );
    // On a thread of its own, with no worker maintenance to expire anything behind our back.
    let drained = std::thread::spawn(move || tenure::testing::drain(builder));
    parks.recv_timeout(LONG).unwrap();
    let waiting = jobs::enqueue_parked(
        &mut conn,
        &NewJob::new("other", "k", vec![]),
        Duration::ZERO,
    )
    .unwrap();
    let deadline = jobs::park_record(&mut conn, waiting.id)
        .unwrap()
        .unwrap()
        .deadline;
    wait_until("the database clock passes the deadline", LONG, || {
        (tenure::database_now(&mut conn).unwrap() > deadline).then_some(())
    });
    assert_eq!(job_state(&mut conn, hanging), JobState::Running);
    assert_eq!(jobs::expire_parked(&mut conn, 1).unwrap(), vec![waiting.id]);
    // Once the run returns the job is parked, and its own past deadline expires it.
    release.send(()).unwrap();
    drained.join().unwrap().unwrap();
    assert_eq!(job_state(&mut conn, hanging), JobState::Parked);
    assert_eq!(jobs::expire_parked(&mut conn, 10).unwrap(), vec![hanging]);
}

//! Snoozing a claimed job (`jobs::snooze`): back to waiting for later without using an
//! attempt, bounded by `MAX_FREE_SNOOZES`, fenced by the claim's token like the other
//! finishing calls.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::RunQueryDsl;
use tenure::jobs::{self, JobClaim, JobState, NewJob, Outcome};
use tenure::worker::{Event, JobContext, JobError, RunOutcome, Worker};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, conformance};

conformance!(
    snoozes_use_no_attempt,
    a_snoozed_job_waits_for_its_due_time,
    a_snooze_is_fenced_by_the_claim_token,
    past_the_free_snoozes_attempts_are_used_then_the_job_dies,
    a_snooze_too_long_is_refused_and_changes_nothing,
    a_job_asked_to_cancel_is_cancelled_by_a_snooze,
    a_snooze_that_uses_the_last_attempt_is_reported_dead,
);

const TTL: Duration = Duration::from_secs(60);

fn claim_one(conn: &mut AnyConnection, queue: &str) -> jobs::ClaimedJob {
    let mut claimed = jobs::claim(conn, queue, 1, TTL).unwrap();
    assert_eq!(claimed.len(), 1, "one job due on {queue}");
    claimed.remove(0)
}

fn snoozes_use_no_attempt(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("s", "k", vec![]).max_attempts(2))
        .unwrap()
        .id;
    for round in 1..=5 {
        let job = claim_one(&mut conn, "s");
        assert_eq!(
            job.attempt, 1,
            "round {round}: every run is the first attempt"
        );
        let outcome = jobs::snooze(&mut conn, job.claim(), Duration::ZERO).unwrap();
        assert_eq!(outcome, Outcome::Done);
        let stored = jobs::get(&mut conn, id).unwrap().unwrap();
        assert_eq!(stored.state, JobState::Waiting);
        assert_eq!((stored.attempt, stored.snoozes), (0, round));
        assert_eq!(stored.claim_expires_at, None);
    }
    let job = claim_one(&mut conn, "s");
    assert_eq!(
        jobs::complete(&mut conn, &[job.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(stored.state, JobState::Completed);
    assert_eq!((stored.attempt, stored.snoozes), (1, 5));
    assert!(jobs::history(&mut conn, id).unwrap().is_empty());
}

fn a_snoozed_job_waits_for_its_due_time(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("s", "k", vec![]))
        .unwrap()
        .id;
    let job = claim_one(&mut conn, "s");
    let outcome = jobs::snooze(&mut conn, job.claim(), Duration::from_secs(3600)).unwrap();
    assert_eq!(outcome, Outcome::Done);
    assert!(jobs::claim(&mut conn, "s", 10, TTL).unwrap().is_empty());
    assert!(
        jobs::claim_kinds(&mut conn, "s", &["k"], 10, TTL)
            .unwrap()
            .is_empty()
    );
    // Due an hour after the snooze by the database's clock (read once, after it).
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    let now = tenure::database_now(&mut conn).unwrap();
    let ahead = stored.due_at - now;
    assert!(
        ahead > chrono::Duration::minutes(59) && ahead <= chrono::Duration::minutes(60),
        "due {ahead} after the database's now"
    );
    assert_eq!((stored.state, stored.attempt), (JobState::Waiting, 0));
}

fn a_snooze_is_fenced_by_the_claim_token(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("s", "k", vec![]))
        .unwrap()
        .id;
    let first = claim_one(&mut conn, "s");
    assert_eq!(
        jobs::snooze(&mut conn, first.claim(), Duration::ZERO).unwrap(),
        Outcome::Done
    );
    // The same call again (a retry after a lost reply): already done, nothing changed.
    assert_eq!(
        jobs::snooze(&mut conn, first.claim(), Duration::ZERO).unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(jobs::get(&mut conn, id).unwrap().unwrap().snoozes, 1);
    // Claimed again: the first claim's token is stale.
    let second = claim_one(&mut conn, "s");
    let before = jobs::get(&mut conn, id).unwrap().unwrap();
    for stale in [
        first.claim(),
        JobClaim {
            id,
            token: uuid::Uuid::new_v4(),
        },
    ] {
        assert_eq!(
            jobs::snooze(&mut conn, stale, Duration::from_secs(3600)).unwrap(),
            Outcome::Lost
        );
    }
    assert_eq!(jobs::get(&mut conn, id).unwrap().unwrap(), before);
    assert_eq!(before.state, JobState::Running);
    // The job is the second claim's: it completes with it.
    assert_eq!(
        jobs::complete(&mut conn, &[second.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    // A job that does not exist: lost.
    let missing = JobClaim {
        id: id + 1000,
        token: second.token,
    };
    assert_eq!(
        jobs::snooze(&mut conn, missing, Duration::ZERO).unwrap(),
        Outcome::Lost
    );
}

fn past_the_free_snoozes_attempts_are_used_then_the_job_dies(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("s", "k", vec![]).max_attempts(2))
        .unwrap()
        .id;
    for _ in 0..jobs::MAX_FREE_SNOOZES {
        let job = claim_one(&mut conn, "s");
        assert_eq!(job.attempt, 1);
        jobs::snooze(&mut conn, job.claim(), Duration::ZERO).unwrap();
    }
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(
        (stored.attempt, stored.snoozes),
        (0, jobs::MAX_FREE_SNOOZES)
    );
    // The next snooze uses the attempt.
    let job = claim_one(&mut conn, "s");
    assert_eq!(job.attempt, 1);
    assert_eq!(
        jobs::snooze(&mut conn, job.claim(), Duration::ZERO).unwrap(),
        Outcome::Done
    );
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(stored.state, JobState::Waiting);
    assert_eq!(
        (stored.attempt, stored.snoozes),
        (1, jobs::MAX_FREE_SNOOZES + 1)
    );
    // And the one after that, on the last attempt, leaves the job dead.
    let job = claim_one(&mut conn, "s");
    assert_eq!(job.attempt, 2);
    assert_eq!(
        jobs::snooze(&mut conn, job.claim(), Duration::ZERO).unwrap(),
        Outcome::Done
    );
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    let n = jobs::MAX_FREE_SNOOZES + 2;
    let error = format!("snoozed {n} times; out of attempts");
    assert_eq!(stored.state, JobState::Dead);
    assert_eq!((stored.attempt, stored.snoozes), (2, n));
    assert!(stored.finished_at.is_some());
    assert_eq!(stored.last_error.as_deref(), Some(error.as_str()));
    let history = jobs::history(&mut conn, id).unwrap();
    assert_eq!(history.len(), 1, "{history:?}");
    assert_eq!(
        (history[0].attempt, history[0].error.as_str()),
        (2, error.as_str())
    );
    assert_eq!(
        jobs::snooze(&mut conn, job.claim(), Duration::ZERO).unwrap(),
        Outcome::AlreadyDone
    );
    assert!(jobs::claim(&mut conn, "s", 1, TTL).unwrap().is_empty());
    // A retried dead job starts over: attempts and snoozes.
    assert!(jobs::retry_dead(&mut conn, id).unwrap());
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!((stored.attempt, stored.snoozes), (0, 0));
}

fn a_snooze_too_long_is_refused_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("s", "k", vec![]))
        .unwrap()
        .id;
    let job = claim_one(&mut conn, "s");
    let before = jobs::get(&mut conn, id).unwrap().unwrap();
    for delay in [tenure::MAX_TTL + Duration::from_secs(1), Duration::MAX] {
        match jobs::snooze(&mut conn, job.claim(), delay) {
            Err(Error::InvalidInput { .. }) => {}
            other => panic!("{delay:?}: {other:?}"),
        }
    }
    assert_eq!(jobs::get(&mut conn, id).unwrap().unwrap(), before);
    // The longest delay is fine.
    assert_eq!(
        jobs::snooze(&mut conn, job.claim(), tenure::MAX_TTL).unwrap(),
        Outcome::Done
    );
}

fn a_job_asked_to_cancel_is_cancelled_by_a_snooze(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("s", "k", vec![]))
        .unwrap()
        .id;
    let job = claim_one(&mut conn, "s");
    assert!(jobs::cancel(&mut conn, id).unwrap());
    assert_eq!(
        jobs::snooze(&mut conn, job.claim(), Duration::ZERO).unwrap(),
        Outcome::Cancelled
    );
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(stored.state, JobState::Cancelled);
    assert_eq!(stored.snoozes, 0);
    assert!(jobs::claim(&mut conn, "s", 1, TTL).unwrap().is_empty());
}

/// Collects a worker's run events.
fn run_events() -> (
    Arc<Mutex<Vec<tenure::worker::RunEvent>>>,
    impl Fn(&Event) + Send + Sync + 'static,
) {
    let events: Arc<Mutex<Vec<tenure::worker::RunEvent>>> = Arc::default();
    let sink = events.clone();
    (events, move |event: &Event| {
        if let Event::Run(run) = event {
            sink.lock().unwrap().push(run.clone());
        }
    })
}

/// A job one snooze short of the free ones, with two attempts, that always snoozes: a free
/// snooze, a paid one (attempt 1 used), then a snooze with no attempt left kills it. The
/// database says dead: so must the event and the report (not "snoozed").
fn a_snooze_that_uses_the_last_attempt_is_reported_dead(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = pool.get().unwrap();
    let id = jobs::enqueue(&mut conn, &NewJob::new("sz", "nap", vec![]).max_attempts(2))
        .unwrap()
        .id;
    let free_left = jobs::MAX_FREE_SNOOZES - 1;
    diesel::sql_query(format!(
        "UPDATE tenure_jobs SET snoozes = {free_left} WHERE id = {id}"
    ))
    .execute(&mut db.connect())
    .unwrap();
    drop(conn);
    let (events, hook) = run_events();
    let report = Worker::builder(pool.clone())
        .queue("sz")
        .raw_handler("nap", |_: &JobContext, _: &[u8]| {
            Err(JobError::snooze(Duration::ZERO))
        })
        .on_event(hook)
        .drain()
        .unwrap();
    let stored = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
    assert_eq!(stored.state, JobState::Dead, "{stored:?}");
    assert_eq!(
        (stored.attempt, stored.snoozes),
        (2, jobs::MAX_FREE_SNOOZES + 2)
    );
    let events = events.lock().unwrap().clone();
    let seen: Vec<(u32, RunOutcome)> = events.iter().map(|e| (e.attempt, e.outcome)).collect();
    assert_eq!(
        seen,
        vec![
            (1, RunOutcome::Snoozed),
            (1, RunOutcome::Snoozed),
            (2, RunOutcome::Dead)
        ],
        "the events must say what the database recorded; report {report:?}"
    );
    assert_eq!((report.snoozed, report.dead), (2, 1), "{report:?}");
    let error = events[2].error.clone().unwrap_or_default();
    assert!(error.contains("out of attempts"), "{error:?}");
}

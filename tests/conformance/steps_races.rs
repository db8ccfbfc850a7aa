//! Durable steps against everything else that touches their job: a run that lost its claim,
//! or whose job was asked to cancel, gets `Error::ClaimLost` from every step (stored or not)
//! and commits nothing; two threads of one run on one step name commit it once, in a worker
//! and in a context made for a test; a prune racing a revival or a step never loses a live
//! job's steps nor fails a step; a job's steps before a park do not run again after its
//! resume. (Steps in general: `steps`; values and names: `steps_values`.) Found by the
//! steps attack round.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::jobs::{self, Finished, JobClaim, JobState, NewJob, Outcome, Retention, StepError};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Error, testing};

use crate::common::{
    TestDb, claim_one, conformance, contest, count, wait_for_db_clock, wait_until,
};
use crate::steps::{create_writes, write, writes};

conformance!(
    a_run_asked_to_cancel_commits_no_step,
    a_lost_run_gets_claim_lost_for_a_step_stored_since,
    two_threads_of_one_run_on_one_name_commit_once,
    two_threads_of_a_test_context_on_one_name_commit_once,
    a_prune_racing_a_revival_keeps_the_revived_jobs_steps,
    steps_and_prunes_of_one_queue_race_without_errors,
    steps_before_a_park_do_not_run_again_after_the_resume,
);

const LONG: Duration = Duration::from_secs(120);
const ROUNDS: usize = 200;

fn stored(conn: &mut AnyConnection, job: i64) -> usize {
    jobs::steps(conn, job).unwrap().len()
}

/// A running job asked to cancel (`jobs::cancel`) stays running under its claim until its
/// handler returns, and is then cancelled whatever the run did: a step it runs meanwhile is
/// refused with `Error::ClaimLost` and its write rolled back, as a park is. Before the fix the
/// step committed its write into a job that was then cancelled (all three backends).
fn a_run_asked_to_cancel_commits_no_step(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let claim = claim_one(&mut conn, "q", "k").claim();
    let before: u8 = jobs::run_step(&mut conn, claim, "before", |conn| {
        write(conn, id, "before")?;
        Ok::<_, JobError>(1)
    })
    .unwrap();
    assert_eq!(before, 1);
    assert!(jobs::cancel(&mut conn, id).unwrap(), "asked to cancel");
    assert_eq!(
        jobs::get(&mut conn, id).unwrap().unwrap().state,
        JobState::Running
    );
    let after = jobs::run_step(&mut conn, claim, "after", |conn| {
        write(conn, id, "after")?;
        Ok::<_, JobError>(2u8)
    });
    assert!(
        matches!(after, Err(StepError::Tenure(Error::ClaimLost { id: lost })) if lost == id),
        "{after:?}"
    );
    assert_eq!(writes(&mut conn, id, "after"), 0);
    assert_eq!(stored(&mut conn, id), 1);
    assert_eq!(
        jobs::complete(&mut conn, &[claim]).unwrap(),
        vec![Outcome::Cancelled]
    );
}

/// The old run of a job that was rescued and claimed again, whose new run stored step "s":
/// the old run asking for "s" gets `Error::ClaimLost`, not the new run's value (it must not
/// go on as if it held the job); so does a run asking for a stored step after its job
/// finished. Before the fix both got the stored value (all three backends).
fn a_lost_run_gets_claim_lost_for_a_step_stored_since(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let old = jobs::claim(&mut conn, "q", 1, Duration::from_millis(200))
        .unwrap()
        .remove(0)
        .claim();
    let expires = jobs::get(&mut conn, id)
        .unwrap()
        .unwrap()
        .claim_expires_at
        .unwrap();
    wait_for_db_clock(&mut conn, expires);
    assert_eq!(jobs::rescue(&mut conn, 10).unwrap().requeued, vec![id]);
    let new = claim_one(&mut conn, "q", "k").claim();
    let s: String = jobs::run_step(&mut conn, new, "s", |_| {
        Ok::<_, JobError>("new run".to_string())
    })
    .unwrap();
    assert_eq!(s, "new run");
    let lost = jobs::run_step(&mut conn, old, "s", |_| {
        Ok::<_, JobError>("old run".to_string())
    });
    assert!(
        matches!(lost, Err(StepError::Tenure(Error::ClaimLost { id: lost })) if lost == id),
        "the lost run got {lost:?}"
    );
    assert_eq!(
        jobs::complete(&mut conn, &[new]).unwrap(),
        vec![Outcome::Done]
    );
    let finished = jobs::run_step(&mut conn, new, "s", |_| {
        Ok::<_, JobError>("after".to_string())
    });
    assert!(finished.unwrap_err().is_claim_lost());
    assert_eq!(stored(&mut conn, id), 1);
}

/// Claims made up front, one job per round, held past the test.
fn claims(conn: &mut AnyConnection, queue: &str, n: usize) -> Vec<JobClaim> {
    let batch: Vec<NewJob> = (0..n).map(|_| NewJob::new(queue, "k", vec![])).collect();
    jobs::enqueue_many(conn, &batch).unwrap();
    let mut claimed = Vec::new();
    while claimed.len() < n {
        let more = jobs::claim(conn, queue, 500, Duration::from_secs(3600)).unwrap();
        assert!(!more.is_empty());
        claimed.extend(more.into_iter().map(|c| c.claim()));
    }
    claimed.sort_by_key(|c| c.id);
    claimed
}

/// Per round, two threads on their own connections run step "s" of one claim at once (as two
/// threads of one handler would), each writing a row and returning its thread number: the
/// step is stored once, one write landed, and both threads got the stored value.
fn two_threads_of_one_run_on_one_name_commit_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    create_writes(&mut setup);
    let claims = Arc::new(claims(&mut setup, "twin", ROUNDS));
    let shared = claims.clone();
    let mut ran_both = 0;
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, conn| {
            let claim = shared[round];
            let mut ran = false;
            let got: usize = jobs::run_step(conn, claim, "s", |conn| {
                ran = true;
                write(conn, claim.id, "s")?;
                Ok::<_, JobError>(thread)
            })
            .unwrap_or_else(|e| panic!("round {round}, thread {thread}: {e}"));
            (got, ran)
        },
        |round, outcomes| {
            assert_eq!(outcomes[0].0, outcomes[1].0, "round {round}: {outcomes:?}");
            if outcomes[0].1 && outcomes[1].1 {
                ran_both += 1;
            }
        },
    );
    for (round, claim) in claims.iter().enumerate() {
        assert_eq!(writes(&mut setup, claim.id, "s"), 1, "round {round}");
        assert_eq!(stored(&mut setup, claim.id), 1, "round {round}");
    }
    eprintln!("both closures ran in {ran_both} of {ROUNDS} rounds");
}

/// The same in a context made for a unit test (`testing::with_pool`): it must behave as a
/// worker's does, so its second thread gets the kept value and its write is rolled back.
/// Before the fix both threads' closures committed their writes in most rounds (all three
/// backends): the context kept a step only after its transaction committed.
fn two_threads_of_a_test_context_on_one_name_commit_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let mut setup = db.connect();
    create_writes(&mut setup);
    let contexts: Arc<Vec<JobContext>> = Arc::new(
        (0..ROUNDS)
            .map(|_| testing::with_pool(testing::context("q", "k"), &pool))
            .collect(),
    );
    let shared = contexts.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, _conn| {
            shared[round]
                .step("s", |conn| {
                    write(conn, round as i64, "s")?;
                    Ok::<_, JobError>(thread)
                })
                .unwrap_or_else(|e| panic!("round {round}, thread {thread}: {e}"))
        },
        |round, outcomes| {
            assert_eq!(
                outcomes[0], outcomes[1],
                "round {round}: each thread got its own closure's value: both committed"
            )
        },
    );
    let twice = (0..ROUNDS)
        .filter(|round| writes(&mut setup, *round as i64, "s") != 1)
        .count();
    assert_eq!(
        twice, 0,
        "rounds whose step wrote other than once, of {ROUNDS}"
    );
}

/// Per round, a dead job with a stored step: one thread prunes the queue's dead jobs while
/// another revives the job (`retry_dead`). Either the job is gone with its steps, or it
/// lives (revived) with them: a revived job never lost its steps to the prune.
fn a_prune_racing_a_revival_keeps_the_revived_jobs_steps(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    let ids: Vec<i64> = claims(&mut setup, "dead", ROUNDS)
        .into_iter()
        .map(|claim| {
            let _: u8 = jobs::run_step(&mut setup, claim, "a", |_| Ok::<_, JobError>(1)).unwrap();
            let _ = jobs::fail(&mut setup, claim, "stop", tenure::jobs::Retry::Never).unwrap();
            claim.id
        })
        .collect();
    let ids = Arc::new(ids);
    let shared = ids.clone();
    let mut outcomes_seen = [0usize; 2];
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, conn| {
            if thread == 0 {
                jobs::prune(conn, "dead", Finished::Dead, Retention::DeleteAll, 1)
                    .unwrap_or_else(|e| panic!("round {round}: prune: {e}"))
            } else {
                usize::from(
                    jobs::retry_dead(conn, shared[round])
                        .unwrap_or_else(|e| panic!("round {round}: retry_dead: {e}")),
                )
            }
        },
        |_, outcomes| outcomes_seen[outcomes[1]] += 1,
    );
    for (round, id) in ids.iter().enumerate() {
        let job = jobs::get(&mut setup, *id).unwrap();
        let steps = stored(&mut setup, *id);
        match job {
            Some(job) => assert_eq!(steps, 1, "round {round}: job {id} {:?}", job.state),
            None => assert_eq!(steps, 0, "round {round}: job {id} pruned"),
        }
    }
    eprintln!("{outcomes_seen:?} rounds not revived/revived");
}

/// Per round, one thread claims a fresh job of queue "mixed", runs two steps and completes it
/// while another prunes the queue's completed jobs (the earlier rounds'): no step and no
/// prune fails (a deadlock between a step's insert and a prune's delete would), every
/// completed round's steps go with the prune, and no running job's steps do.
fn steps_and_prunes_of_one_queue_race_without_errors(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    let claims = Arc::new(claims(&mut setup, "mixed", ROUNDS));
    let shared = claims.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, conn| {
            if thread == 0 {
                let claim = shared[round];
                for name in ["a", "b"] {
                    let _: usize = jobs::run_step(conn, claim, name, |_| Ok::<_, JobError>(round))
                        .unwrap_or_else(|e| panic!("round {round}: step {name}: {e}"));
                }
                assert_eq!(stored(conn, claim.id), 2, "round {round}");
                jobs::complete(conn, &[claim]).unwrap();
                0
            } else {
                jobs::prune(
                    conn,
                    "mixed",
                    Finished::Completed,
                    Retention::DeleteAll,
                    1000,
                )
                .unwrap_or_else(|e| panic!("round {round}: prune: {e}"))
            }
        },
        |_, _| {},
    );
    jobs::prune(
        &mut setup,
        "mixed",
        Finished::Completed,
        Retention::DeleteAll,
        1000,
    )
    .unwrap();
    assert_eq!(
        count(&mut setup, "SELECT COUNT(*) AS n FROM tenure_steps"),
        0
    );
}

/// A handler runs step "a", parks, and returns; resumed, its next run asks for "a" again and
/// then runs "b": "a" ran once, its write landed once, and the resumed run got the value the
/// first run stored. A step after the park, in the run that parked, commits too (the job is
/// still the run's until the handler returns).
fn steps_before_a_park_do_not_run_again_after_the_resume(backend: Backend) {
    const JOBS: usize = 5;
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let runs: Arc<[AtomicUsize; 3]> = Arc::default();
    let (tokens, received) = channel();
    let tokens = Mutex::new(tokens);
    let r = runs.clone();
    let worker = Worker::builder(pool.clone())
        .queue("p")
        .threads(2)
        .poll_interval(Duration::from_millis(50))
        .raw_handler("park", move |ctx: &JobContext, _: &[u8]| {
            let a: i64 = ctx.step("a", |conn| {
                r[0].fetch_add(1, Ordering::SeqCst);
                write(conn, ctx.id, "a")?;
                Ok::<_, JobError>(ctx.id * 10)
            })?;
            assert_eq!(a, ctx.id * 10);
            if ctx.resume_value()?.is_none() {
                let token = ctx.park(LONG)?;
                ctx.step("after-park", |conn| {
                    r[1].fetch_add(1, Ordering::SeqCst);
                    write(conn, ctx.id, "after-park")?;
                    Ok::<_, JobError>(())
                })?;
                tokens.lock().unwrap().send(token).unwrap();
                return Err(JobError::parked());
            }
            ctx.step("b", |conn| {
                r[2].fetch_add(1, Ordering::SeqCst);
                write(conn, ctx.id, "b")?;
                Ok::<_, JobError>(())
            })?;
            Ok(())
        })
        .start()
        .unwrap();
    let ids: Vec<i64> = (0..JOBS)
        .map(|_| {
            jobs::enqueue(&mut conn, &NewJob::new("p", "park", vec![]))
                .unwrap()
                .id
        })
        .collect();
    for _ in 0..JOBS {
        let token = received.recv_timeout(LONG).unwrap();
        let id = token.job_id();
        wait_until(&format!("job {id} parked"), LONG, || {
            (jobs::get(&mut conn, id).unwrap().unwrap().state == JobState::Parked).then_some(())
        });
        let value = tenure::jobs::JobResult::json(&"go").unwrap();
        jobs::resume_parked(&mut conn, &token, Some(&value)).unwrap();
    }
    for id in &ids {
        let ended = jobs::wait(&pool, *id, LONG).unwrap();
        assert_eq!(ended.job.state, JobState::Completed, "job {id}");
        for step in ["a", "after-park", "b"] {
            assert_eq!(writes(&mut conn, *id, step), 1, "job {id} step {step}");
        }
        assert_eq!(stored(&mut conn, *id), 3);
    }
    let runs: Vec<usize> = runs.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    assert_eq!(runs, vec![JOBS; 3], "each step's closure ran once per job");
    worker.shutdown(LONG);
}

//! Durable steps (`JobContext::step`, `jobs::run_step`): a step's result commits with the
//! step's own writes, only while the run holds its claim; a retry gets the stored result and
//! the step does not run again; a failing or refused step commits nothing; steps go with
//! their job at retention and stay through a revival; they work under `testing::drain` and
//! in a test context given a pool. (Killed worker processes: `faults::steps`.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::RunQueryDsl;
use tenure::jobs::{self, Backoff, Finished, JobState, NewJob, Outcome, Retention, StepError};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Error, testing};

use crate::common::{TestDb, claim_one, conformance, contest, count, wait_for_db_clock};

conformance!(
    a_retry_gets_stored_results_and_runs_no_completed_step_again,
    a_failing_step_stores_nothing_and_fails_the_run_as_its_error_says,
    a_run_that_lost_its_claim_commits_nothing_of_its_step,
    a_step_racing_a_reclaim_commits_before_it_or_not_at_all,
    a_result_too_long_or_a_bad_name_is_refused_and_commits_nothing,
    retention_deletes_steps_with_their_job_and_a_revival_resumes,
    a_test_context_runs_steps_with_a_pool_and_refuses_without,
);

const TTL: Duration = Duration::from_secs(60);

/// The user table the steps write to (shared with `steps_races` and `steps_values`).
pub(crate) fn create_writes(conn: &mut AnyConnection) {
    diesel::sql_query(
        "CREATE TABLE step_writes (job_id BIGINT NOT NULL, step VARCHAR(64) NOT NULL)",
    )
    .execute(conn)
    .unwrap();
}

pub(crate) fn write(conn: &mut AnyConnection, job: i64, step: &str) -> diesel::QueryResult<usize> {
    // Test values only (a job id and a fixed step name): formatted, not bound.
    diesel::sql_query(format!(
        "INSERT INTO step_writes (job_id, step) VALUES ({job}, '{step}')"
    ))
    .execute(conn)
}

pub(crate) fn writes(conn: &mut AnyConnection, job: i64, step: &str) -> i64 {
    count(
        conn,
        &format!("SELECT COUNT(*) AS n FROM step_writes WHERE job_id = {job} AND step = '{step}'"),
    )
}

fn step_names(conn: &mut AnyConnection, job: i64) -> Vec<String> {
    jobs::steps(conn, job)
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect()
}

/// Retries due at once, so a drain runs them.
fn no_backoff() -> Backoff {
    Backoff {
        base: Duration::ZERO,
        max: Duration::ZERO,
    }
}

/// A handler of three steps, each writing a row and counting its runs; the first run fails
/// after step "b", the second completes. Step "a" is asked for twice per run. Under
/// `testing::drain`: the retry gets "a" and "b" back (the values of the first run), runs
/// only "c", and every step wrote once.
fn a_retry_gets_stored_results_and_runs_no_completed_step_again(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let id = jobs::enqueue(&mut conn, &NewJob::new("batch", "three", vec![]))
        .unwrap()
        .id;
    let runs: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
    let seen: Arc<Mutex<Vec<(u32, String, i64)>>> = Arc::default();
    let (r, s) = (runs.clone(), seen.clone());
    let report = testing::drain(
        Worker::builder(pool.clone())
            .queue("batch")
            .backoff(no_backoff())
            .raw_handler("three", move |ctx: &JobContext, _: &[u8]| {
                let attempt = ctx.attempt;
                let a: String = ctx.step("a", |conn| {
                    r[0].fetch_add(1, Ordering::SeqCst);
                    write(conn, ctx.id, "a")?;
                    Ok::<_, JobError>(format!("fetched on run {attempt}"))
                })?;
                let again: String = ctx.step("a", |_conn| {
                    r[0].fetch_add(1, Ordering::SeqCst);
                    Ok::<_, JobError>("never".to_string())
                })?;
                assert_eq!(a, again, "the same name twice: the stored value");
                let b: i64 = ctx.step("b", |conn| {
                    r[1].fetch_add(1, Ordering::SeqCst);
                    write(conn, ctx.id, "b")?;
                    Ok::<_, JobError>(i64::from(attempt) * 100)
                })?;
                s.lock().unwrap().push((attempt, a, b));
                if attempt == 1 {
                    return Err(JobError::retry("crash after step b"));
                }
                ctx.step("c", |conn| {
                    r[2].fetch_add(1, Ordering::SeqCst);
                    write(conn, ctx.id, "c")?;
                    Ok::<_, JobError>(())
                })?;
                Ok(())
            }),
    )
    .unwrap();
    assert_eq!((report.completed, report.retried), (1, 1), "{report:?}");
    let runs: Vec<usize> = runs.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    assert_eq!(runs, vec![1, 1, 1], "each step's closure ran once");
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (1, "fetched on run 1".to_string(), 100),
            (2, "fetched on run 1".to_string(), 100),
        ],
        "the retry got the first run's results"
    );
    for step in ["a", "b", "c"] {
        assert_eq!(writes(&mut conn, id, step), 1, "step {step}'s write");
    }
    assert_eq!(step_names(&mut conn, id), vec!["a", "b", "c"]);
    let stored = jobs::steps(&mut conn, id).unwrap();
    assert_eq!(stored[1].decode::<i64>().unwrap(), 100);
    assert_eq!(
        jobs::get(&mut conn, id).unwrap().unwrap().state,
        JobState::Completed
    );
}

/// A step whose closure writes and then fails: its write is rolled back, nothing is stored,
/// and the run fails as the closure's error says (a retry per policy; `JobError::dead` dead).
fn a_failing_step_stores_nothing_and_fails_the_run_as_its_error_says(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let retried = jobs::enqueue(&mut conn, &NewJob::new("q", "flaky", vec![]))
        .unwrap()
        .id;
    let dead = jobs::enqueue(&mut conn, &NewJob::new("q", "doomed", vec![]))
        .unwrap()
        .id;
    let report = testing::drain(
        Worker::builder(pool.clone())
            .queue("q")
            .backoff(no_backoff())
            .raw_handler("flaky", |ctx: &JobContext, _: &[u8]| {
                let attempt = ctx.attempt;
                ctx.step("s", |conn| {
                    write(conn, ctx.id, "s")?;
                    if attempt == 1 {
                        return Err(JobError::retry("the upstream is down"));
                    }
                    Ok(attempt)
                })?;
                Ok(())
            })
            .raw_handler("doomed", |ctx: &JobContext, _: &[u8]| {
                ctx.step("s", |conn| {
                    write(conn, ctx.id, "s")?;
                    Err::<(), _>(JobError::dead("bad input"))
                })?;
                Ok(())
            }),
    )
    .unwrap();
    assert_eq!((report.completed, report.dead), (1, 1), "{report:?}");
    // The failed run's write vanished; the second run's landed, once.
    assert_eq!(writes(&mut conn, retried, "s"), 1);
    assert_eq!(
        jobs::steps(&mut conn, retried).unwrap()[0]
            .decode::<u32>()
            .unwrap(),
        2
    );
    let history = jobs::history(&mut conn, retried).unwrap();
    assert!(
        history[0].error.contains("the upstream is down"),
        "{history:?}"
    );
    assert_eq!(writes(&mut conn, dead, "s"), 0);
    assert!(jobs::steps(&mut conn, dead).unwrap().is_empty());
    let job = jobs::get(&mut conn, dead).unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    assert!(job.last_error.unwrap().contains("bad input"));
}

/// A claim that lapsed and was rescued and claimed again: the old run's step is refused with
/// `Error::ClaimLost` before its closure runs, and writes nothing; a step it completed before
/// is kept, and the new run gets it back and completes the rest.
fn a_run_that_lost_its_claim_commits_nothing_of_its_step(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let old = jobs::claim(&mut conn, "q", 1, Duration::from_millis(200))
        .unwrap()
        .remove(0);
    let first: i32 = jobs::run_step(&mut conn, old.claim(), "a", |conn| {
        write(conn, id, "a")?;
        Ok::<_, diesel::result::Error>(1)
    })
    .unwrap();
    assert_eq!(first, 1);
    // The claim lapses (database clock) and a rescue takes it back; another run claims it.
    let expires = jobs::get(&mut conn, id)
        .unwrap()
        .unwrap()
        .claim_expires_at
        .unwrap();
    wait_for_db_clock(&mut conn, expires);
    assert_eq!(jobs::rescue(&mut conn, 10).unwrap().requeued, vec![id]);
    // The old run, lost and not yet knowing it: its step is refused, its closure does not
    // even run (the claim is read before it; a claim lost while the closure runs is the race
    // test's case: its write is rolled back).
    let mut ran = false;
    let lost = jobs::run_step(&mut conn, old.claim(), "b", |conn| {
        ran = true;
        write(conn, id, "b")?;
        Ok::<_, diesel::result::Error>(2)
    })
    .unwrap_err();
    assert!(!ran);
    assert!(lost.is_claim_lost(), "{lost:?}");
    assert!(matches!(lost, StepError::Tenure(Error::ClaimLost { id: lost_id }) if lost_id == id));
    assert_eq!(writes(&mut conn, id, "b"), 0);
    assert_eq!(step_names(&mut conn, id), vec!["a"]);
    let new = claim_one(&mut conn, "q", "k");
    // Also refused once the job runs under the new claim.
    let stale = jobs::run_step(&mut conn, old.claim(), "b", |conn| {
        write(conn, id, "b")?;
        Ok::<_, diesel::result::Error>(2)
    });
    assert!(stale.unwrap_err().is_claim_lost());
    let a: i32 = jobs::run_step(&mut conn, new.claim(), "a", |_| {
        Err::<i32, _>("must not run: stored")
    })
    .unwrap();
    let b: i32 = jobs::run_step(&mut conn, new.claim(), "b", |conn| {
        write(conn, id, "b")?;
        Ok::<_, diesel::result::Error>(20)
    })
    .unwrap();
    assert_eq!((a, b), (1, 20));
    assert_eq!(
        jobs::complete(&mut conn, &[new.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    // A finished job takes no step.
    let after = jobs::run_step(&mut conn, new.claim(), "c", |conn| {
        write(conn, id, "c")?;
        Ok::<_, diesel::result::Error>(3)
    });
    assert!(after.unwrap_err().is_claim_lost());
    assert_eq!(
        (
            writes(&mut conn, id, "a"),
            writes(&mut conn, id, "b"),
            writes(&mut conn, id, "c")
        ),
        (1, 1, 0)
    );
}

// 300 rounds took 57 s on MariaDB at load 22 (nextest stops a test at 60 s).
const RACE_ROUNDS: usize = 200;

/// Per round: one thread runs a step under claim A (a job of its own queue) while another
/// gives A back, after a pause that sweeps the step's transaction from round to round, and
/// then reads the job's steps. The step commits before the give back or not at all: whenever
/// the step is stored at the end, the read after the give back saw it (a claim checked
/// without the job row's lock lets the give back slip between the check and the commit: the
/// step then lands behind its back; with the lock taken out of `LOCK_CLAIM` this test saw
/// it), and the step's write exists exactly when the step is stored.
fn a_step_racing_a_reclaim_commits_before_it_or_not_at_all(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    create_writes(&mut setup);
    let claims: Arc<Mutex<Vec<jobs::JobClaim>>> = Arc::default();
    let seen_after_give_back: Arc<Mutex<Vec<usize>>> = Arc::default();
    let (shared_claims, shared_seen) = (claims.clone(), seen_after_give_back.clone());
    let mut stepped = [0usize; 2];
    contest(
        &db,
        2,
        RACE_ROUNDS,
        move |round, thread, conn| {
            if thread == 0 {
                let queue = format!("race-{round}");
                jobs::enqueue(conn, &NewJob::new(&queue, "k", vec![])).unwrap();
                let a = jobs::claim(conn, &queue, 1, TTL).unwrap().remove(0).claim();
                shared_claims.lock().unwrap().push(a);
                let step = jobs::run_step(conn, a, "s", |conn| {
                    write(conn, a.id, "s")?;
                    Ok::<_, diesel::result::Error>(round)
                });
                match step {
                    Ok(_) => 0,
                    Err(e) if e.is_claim_lost() => 1,
                    Err(e) => panic!("round {round}: {e}"),
                }
            } else {
                let a = loop {
                    if let Some(a) = shared_claims.lock().unwrap().get(round).copied() {
                        break a;
                    }
                    std::thread::yield_now();
                };
                // 0 to 3 ms, a different point of the step's transaction each round.
                std::thread::sleep(Duration::from_micros((round as u64 * 37) % 3000));
                assert_eq!(jobs::give_back(conn, &[a]).unwrap(), vec![Outcome::Done]);
                let seen = jobs::steps(conn, a.id).unwrap().len();
                shared_seen.lock().unwrap().push(seen);
                2
            }
        },
        |_, outcomes| stepped[outcomes[0]] += 1,
    );
    let seen = seen_after_give_back.lock().unwrap().clone();
    let claims = claims.lock().unwrap().clone();
    let mut behind = 0;
    for (round, claim) in claims.iter().enumerate() {
        let stored = jobs::steps(&mut setup, claim.id).unwrap().len();
        assert_eq!(
            writes(&mut setup, claim.id, "s") as usize,
            stored,
            "round {round}"
        );
        if stored == 1 && seen[round] == 0 {
            behind += 1;
        }
    }
    assert_eq!(
        behind, 0,
        "steps committed after their claim was given back ({stepped:?} rounds stored/lost)"
    );
    // The steps ran (on SQLite the step's transaction holds the write lock from its start,
    // so the give back almost always comes after it).
    assert!(stepped[0] > 0, "{stepped:?} rounds stored/lost");
    eprintln!("{stepped:?} rounds stored/lost");
}

/// A result longer than `MAX_RESULT_BYTES` as JSON: `Error::InvalidInput`, the closure's
/// write rolled back, nothing stored; the claim is untouched and a step within the bound
/// then commits. Bad names are refused before the closure runs.
fn a_result_too_long_or_a_bad_name_is_refused_and_commits_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let claim = claim_one(&mut conn, "q", "k").claim();
    // JSON adds the two quotes: exactly one byte too long.
    let long = "x".repeat(jobs::MAX_RESULT_BYTES - 1);
    let refused = jobs::run_step(&mut conn, claim, "big", |conn| {
        write(conn, id, "big")?;
        Ok::<_, diesel::result::Error>(long.clone())
    })
    .unwrap_err();
    assert!(
        matches!(
            refused,
            StepError::Tenure(Error::InvalidInput {
                field: "step result",
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(writes(&mut conn, id, "big"), 0);
    assert!(jobs::steps(&mut conn, id).unwrap().is_empty());
    let fits = "x".repeat(jobs::MAX_RESULT_BYTES - 2);
    let stored: String = jobs::run_step(&mut conn, claim, "big", |conn| {
        write(conn, id, "big")?;
        Ok::<_, diesel::result::Error>(fits.clone())
    })
    .unwrap();
    assert_eq!(stored.len(), jobs::MAX_RESULT_BYTES - 2);
    assert_eq!(writes(&mut conn, id, "big"), 1);
    for name in [String::new(), "n".repeat(256), "a\0b".to_string()] {
        let mut ran = false;
        let refused = jobs::run_step(&mut conn, claim, &name, |_| {
            ran = true;
            Ok::<_, diesel::result::Error>(())
        })
        .unwrap_err();
        assert!(!ran, "{name:?}");
        assert!(
            matches!(
                refused,
                StepError::Tenure(Error::InvalidInput {
                    field: "step name",
                    ..
                })
            ),
            "{refused:?}"
        );
    }
    let longest = "n".repeat(255);
    jobs::run_step(&mut conn, claim, &longest, |_| {
        Ok::<_, diesel::result::Error>(())
    })
    .unwrap();
    assert_eq!(step_names(&mut conn, id).len(), 2);
    // A stored result read back as another type: a typed error, not a panic.
    let wrong = jobs::run_step(&mut conn, claim, "big", |_| {
        Ok::<_, diesel::result::Error>(0u8)
    });
    assert!(matches!(
        wrong.unwrap_err(),
        StepError::Tenure(Error::InvalidInput {
            field: "step result",
            ..
        })
    ));
}

/// A job that dies after a step keeps it through `retry_dead`: the revived job resumes (the
/// step does not run again). Pruned, its steps go with it; another job's stay.
fn retention_deletes_steps_with_their_job_and_a_revival_resumes(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let kept = jobs::enqueue(&mut conn, &NewJob::new("other", "k", vec![]))
        .unwrap()
        .id;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = |queue: &str, die: bool| {
        let runs = runs.clone();
        Worker::builder(pool.clone()).queue(queue).raw_handler(
            "k",
            move |ctx: &JobContext, _: &[u8]| {
                ctx.step("a", |conn| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    write(conn, ctx.id, "a")?;
                    Ok::<_, JobError>(())
                })?;
                if die {
                    return Err(JobError::dead("stop here"));
                }
                Ok(())
            },
        )
    };
    assert_eq!(testing::drain(worker("q", true)).unwrap().dead, 1);
    assert_eq!(testing::drain(worker("other", false)).unwrap().completed, 1);
    assert!(jobs::retry_dead(&mut conn, id).unwrap());
    assert_eq!(
        step_names(&mut conn, id),
        vec!["a"],
        "a revival keeps the steps"
    );
    assert_eq!(testing::drain(worker("q", false)).unwrap().completed, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one run of step a per job");
    assert_eq!(writes(&mut conn, id, "a"), 1);
    let pruned = jobs::prune(
        &mut conn,
        "q",
        Finished::Completed,
        Retention::DeleteAll,
        10,
    )
    .unwrap();
    assert_eq!(pruned, 1);
    assert!(jobs::get(&mut conn, id).unwrap().is_none());
    assert!(jobs::steps(&mut conn, id).unwrap().is_empty());
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_steps WHERE job_id = {id}")
        ),
        0
    );
    assert_eq!(step_names(&mut conn, kept), vec!["a"]);
}

/// A context made for a unit test: without a pool a step is a typed error and its closure
/// does not run; given a pool (`testing::with_pool`), its closure runs once in a transaction
/// (its write commits) and a second call, on a clone too, returns the kept value.
fn a_test_context_runs_steps_with_a_pool_and_refuses_without(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    let mut conn = db.connect();
    create_writes(&mut conn);
    let bare = testing::context("q", "k");
    let mut ran = false;
    let refused = bare
        .step("a", |_| {
            ran = true;
            Ok::<_, JobError>(1)
        })
        .unwrap_err();
    assert!(!ran);
    assert!(matches!(
        refused,
        StepError::Tenure(Error::InvalidInput {
            field: "context",
            ..
        })
    ));
    let ctx = testing::with_pool(testing::context("q", "k"), &pool);
    let runs = AtomicUsize::new(0);
    let step = |ctx: &JobContext| {
        ctx.step("a", |conn| {
            runs.fetch_add(1, Ordering::SeqCst);
            write(conn, 7, "a")?;
            Ok::<_, JobError>(vec![1, 2])
        })
    };
    assert_eq!(step(&ctx).unwrap(), vec![1, 2]);
    assert_eq!(step(&ctx.clone()).unwrap(), vec![1, 2]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(writes(&mut conn, 7, "a"), 1);
    // A failing closure's write is rolled back there too.
    let failed = ctx.step("b", |conn| {
        write(conn, 7, "b")?;
        Err::<(), _>(JobError::dead("no"))
    });
    assert!(matches!(failed, Err(StepError::Failed(e)) if e.is_dead()));
    assert_eq!(writes(&mut conn, 7, "b"), 0);
    assert!(
        jobs::steps(&mut conn, 0).unwrap().is_empty(),
        "nothing in the table"
    );
}

//! Workflows under contention: real threads on their own connections, many rounds, counted.
//! The decision "the last dependency finished" is made in the finishing transactions, by
//! row-locked counters; these tests finish dependencies at the same instant and check that
//! every dependent is released exactly once, and that a plain count (the negative control)
//! does lose releases.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use diesel::RunQueryDsl;
use tenure::jobs::{self, ClaimedJob, JobResult, JobState, NewJob, Outcome, Workflow};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, concrete, conformance, contest, count};

conformance!(
    a_diamond_join_runs_once_after_both_branches_in_200_workflows_under_8_claimers,
    a_fan_in_of_1000_runs_once_with_no_errors_under_8_claimers,
    dependencies_finishing_at_the_same_instant_release_their_dependent_exactly_once,
    negative_control_a_plain_count_of_pending_dependencies_loses_releases,
    batch_callbacks_fire_exactly_once_when_the_last_jobs_finish_at_the_same_instant,
    batch_callbacks_fire_once_when_a_killed_workers_claims_are_rescued,
    a_dependent_enqueued_while_its_dependency_completes_is_never_left_blocked,
);

const TTL: Duration = Duration::from_secs(120);
const CLAIMERS: usize = 8;
/// A drain that has not finished by then is stuck (a lost release), not slow (the runner
/// ends a test after a minute).
const STUCK_AFTER: Duration = Duration::from_secs(55);

/// What a drain saw.
#[derive(Default)]
struct Drained {
    /// Runs per job id.
    runs: HashMap<i64, usize>,
    errors: Vec<String>,
}

/// Drains `queue` with `CLAIMERS` threads, each on its own connection, claiming up to 4
/// jobs at a time and completing each (with the result `run` returns) in its own
/// transaction, until `total` jobs have completed; a claimer that finds nothing rescues
/// lapsed claims, as an idle worker does. `run` may check the job (it panics the test on a
/// violation).
fn drain(
    db: &TestDb,
    queue: &'static str,
    total: usize,
    run: impl Fn(&mut AnyConnection, &ClaimedJob) -> Option<JobResult> + Send + Sync + 'static,
) -> Drained {
    let completed = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Drained::default()));
    let run = Arc::new(run);
    let started = Clock::now();
    let threads: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let (completed, seen, run) = (completed.clone(), seen.clone(), run.clone());
            std::thread::spawn(move || {
                while completed.load(Ordering::SeqCst) < total {
                    assert!(
                        started.elapsed() < STUCK_AFTER,
                        "stuck: {} of {total} completed",
                        completed.load(Ordering::SeqCst)
                    );
                    let claimed = match jobs::claim(&mut conn, queue, 4, TTL) {
                        Ok(claimed) => claimed,
                        Err(e) => {
                            seen.lock().unwrap().errors.push(format!("claim: {e}"));
                            continue;
                        }
                    };
                    if claimed.is_empty() {
                        if let Err(e) = jobs::rescue(&mut conn, 100) {
                            seen.lock().unwrap().errors.push(format!("rescue: {e}"));
                        }
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    for job in claimed {
                        *seen.lock().unwrap().runs.entry(job.id).or_default() += 1;
                        let result = run(&mut conn, &job);
                        let outcome = match &result {
                            Some(result) => {
                                jobs::complete_with_result(&mut conn, job.claim(), result)
                            }
                            None => jobs::complete(&mut conn, &[job.claim()]).map(|o| o[0]),
                        };
                        match outcome {
                            Ok(Outcome::Done) => {
                                completed.fetch_add(1, Ordering::SeqCst);
                            }
                            Ok(other) => seen
                                .lock()
                                .unwrap()
                                .errors
                                .push(format!("job {}: {other:?}", job.id)),
                            Err(e) => seen
                                .lock()
                                .unwrap()
                                .errors
                                .push(format!("complete {}: {e}", job.id)),
                        }
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a claimer panicked");
    }
    Arc::try_unwrap(seen)
        .ok()
        .expect("threads joined")
        .into_inner()
        .unwrap()
}

/// 200 diamonds A -> {B, C} -> D drained by 8 claimers: every job runs once, and every D
/// runs after both its B and C completed (by their states and finish times on the
/// database's clock, read when D runs) and reads both results. No errors.
fn a_diamond_join_runs_once_after_both_branches_in_200_workflows_under_8_claimers(
    backend: Backend,
) {
    const FLOWS: usize = 200;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for i in 0..FLOWS {
        let mut flow = Workflow::new(format!("diamond-{i}"));
        let a = flow.add(NewJob::json("diamond", "a", &i).unwrap());
        let b = flow.add_after(&[a], NewJob::json("diamond", "b", &i).unwrap());
        let c = flow.add_after(&[a], NewJob::json("diamond", "c", &i).unwrap());
        flow.add_after(&[b, c], NewJob::json("diamond", "d", &i).unwrap());
        jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    }
    let joins = Arc::new(AtomicUsize::new(0));
    let joins_seen = joins.clone();
    let drained = drain(&db, "diamond", FLOWS * 4, move |conn, job| {
        let i: usize = job.json().unwrap();
        if job.kind == "d" {
            let inputs = jobs::dependency_results(conn, job.id).unwrap();
            let kinds: Vec<(String, JobState, String)> = inputs
                .iter()
                .map(|d| {
                    (
                        d.kind.clone(),
                        d.state,
                        d.result.as_ref().unwrap().decode::<String>().unwrap(),
                    )
                })
                .collect();
            assert_eq!(
                kinds,
                vec![
                    ("b".into(), JobState::Completed, format!("b{i}")),
                    ("c".into(), JobState::Completed, format!("c{i}")),
                ],
                "join {} ran before its branches completed",
                job.id
            );
            for input in &inputs {
                let finished = jobs::get(conn, input.id)
                    .unwrap()
                    .unwrap()
                    .finished_at
                    .unwrap();
                assert!(
                    finished <= job.claimed_at,
                    "branch {} finished after its join was claimed",
                    input.id
                );
            }
            joins_seen.fetch_add(1, Ordering::SeqCst);
        }
        Some(JobResult::json(&format!("{}{i}", job.kind)).unwrap())
    });
    assert!(
        drained.errors.is_empty(),
        "{backend:?} errors: {:?}",
        drained.errors
    );
    assert_eq!(drained.runs.len(), FLOWS * 4);
    assert!(drained.runs.values().all(|n| *n == 1), "a job ran twice");
    assert_eq!(joins.load(Ordering::SeqCst), FLOWS);
}

/// One merge job depending on 1,000 parts, the parts drained by 8 claimers each completing
/// one part per transaction: the merge runs exactly once, after all 1,000, reads 1,000
/// results, and no call failed (no deadlock on MariaDB). Prints the drain rate.
fn a_fan_in_of_1000_runs_once_with_no_errors_under_8_claimers(backend: Backend) {
    const PARTS: usize = 1000;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut flow = Workflow::new("fan-in");
    let parts: Vec<_> = (0..PARTS)
        .map(|i| flow.add(NewJob::json("fan", "part", &i).unwrap()))
        .collect();
    flow.add_after(&parts, NewJob::new("fan", "merge", vec![]));
    jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    let merged = Arc::new(AtomicUsize::new(0));
    let merged_seen = merged.clone();
    let started = Clock::now();
    let drained = drain(&db, "fan", PARTS + 1, move |conn, job| {
        if job.kind == "merge" {
            let inputs = jobs::dependency_results(conn, job.id).unwrap();
            assert_eq!(inputs.len(), PARTS);
            let sum: usize = inputs
                .iter()
                .map(|d| d.result.as_ref().unwrap().decode::<usize>().unwrap())
                .sum();
            assert_eq!(sum, PARTS * (PARTS - 1) / 2);
            merged_seen.fetch_add(1, Ordering::SeqCst);
            return None;
        }
        Some(JobResult::json(&job.json::<usize>().unwrap()).unwrap())
    });
    let took = started.elapsed();
    assert!(
        drained.errors.is_empty(),
        "{backend:?} errors: {:?}",
        drained.errors
    );
    assert_eq!(merged.load(Ordering::SeqCst), 1);
    assert!(drained.runs.values().all(|n| *n == 1));
    eprintln!(
        "{backend:?}: fan-in of {PARTS} drained by {CLAIMERS} claimers in {took:?} ({:.0} jobs/s, one completion per transaction)",
        (PARTS + 1) as f64 / took.as_secs_f64()
    );
}

/// Rounds of: a dependent waits for N jobs (N = 2, 8 and 40: one stripe, and several), all
/// claimed; 8 threads complete them at the same instant (a barrier), each its share in one
/// call. After every round the dependent is waiting: released once (never left blocked),
/// its stripes all zero.
fn dependencies_finishing_at_the_same_instant_release_their_dependent_exactly_once(
    backend: Backend,
) {
    const ROUNDS: usize = 60;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let claims: Arc<Mutex<Vec<Vec<jobs::JobClaim>>>> = Arc::new(Mutex::new(Vec::new()));
    let dependent = Arc::new(Mutex::new(0i64));
    let prepare = |conn: &mut AnyConnection, round: usize| {
        let n = [2, 8, 40][round % 3];
        let queue = format!("r{round}");
        let deps =
            jobs::enqueue_many(conn, &vec![NewJob::new(queue.as_str(), "dep", vec![]); n]).unwrap();
        let id = jobs::enqueue(
            conn,
            &NewJob::new(queue.as_str(), "after", vec![]).depends_on(deps.iter().map(|e| e.id)),
        )
        .unwrap()
        .id;
        let claimed = jobs::claim(conn, &queue, 100, TTL).unwrap();
        assert_eq!(claimed.len(), n);
        let mut shares = vec![Vec::new(); CLAIMERS];
        for (i, job) in claimed.iter().enumerate() {
            shares[i % CLAIMERS].push(job.claim());
        }
        (id, shares)
    };
    let (first, shares) = prepare(&mut conn, 0);
    *dependent.lock().unwrap() = first;
    *claims.lock().unwrap() = shares;
    let claims_of = claims.clone();
    contest(
        &db,
        CLAIMERS,
        ROUNDS,
        move |_, thread, conn| {
            let share = claims_of.lock().unwrap()[thread].clone();
            if share.is_empty() {
                return Ok(Vec::new());
            }
            jobs::complete(conn, &share).map_err(|e| e.to_string())
        },
        |round, outcomes| {
            for outcome in &outcomes {
                let outcome = outcome
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{backend:?} round {round}: {e}"));
                assert!(outcome.iter().all(|o| *o == Outcome::Done));
            }
            let id = *dependent.lock().unwrap();
            let job = jobs::get(&mut conn, id).unwrap().unwrap();
            assert_eq!(
                job.state,
                JobState::Waiting,
                "{backend:?} round {round}: dependent {id} not released"
            );
            let pending = count(
                &mut conn,
                &format!(
                    "SELECT COUNT(*) AS n FROM tenure_dependency_stripes WHERE job_id = {id} AND pending <> 0"
                ),
            );
            assert_eq!(pending, 0);
            if round + 1 < ROUNDS {
                let (next, shares) = prepare(&mut conn, round + 1);
                *dependent.lock().unwrap() = next;
                *claims.lock().unwrap() = shares;
            }
        },
    );
}

/// The negative control: the same race with the decision made without a lock, by a plain
/// count of the dependencies not yet done after marking one's own (in the finishing
/// transaction, READ COMMITTED). Two finishes at the same instant each see the other's
/// mark uncommitted, so neither fires: on PostgreSQL and MariaDB some round ends with the
/// dependent never released. (It cannot double-fire: each count sees its own mark, and
/// both would have to see the other's committed.) SQLite runs one writer at a time, so
/// there the plain count happens to be right: it checks that it never fails.
fn negative_control_a_plain_count_of_pending_dependencies_loses_releases(backend: Backend) {
    const ROUNDS: usize = 60;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    concrete!(&mut conn, c => {
        diesel::sql_query("CREATE TABLE naive_edges (round_no INTEGER NOT NULL, dep INTEGER NOT NULL, done INTEGER NOT NULL)")
            .execute(c)
            .unwrap();
        diesel::sql_query("CREATE TABLE naive_fired (round_no INTEGER NOT NULL)").execute(c).unwrap();
        for round in 0..ROUNDS {
            for dep in 0..CLAIMERS {
                diesel::sql_query(format!("INSERT INTO naive_edges VALUES ({round}, {dep}, 0)")).execute(c).unwrap();
            }
        }
    });
    let fired_per_round = Arc::new(Mutex::new(Vec::new()));
    let record = fired_per_round.clone();
    contest(
        &db,
        CLAIMERS,
        ROUNDS,
        move |round, thread, conn| {
            tenure::transaction(conn, |conn| {
                diesel::sql_query(format!("UPDATE naive_edges SET done = 1 WHERE round_no = {round} AND dep = {thread}"))
                    .execute(conn)?;
                let left = count(conn, &format!("SELECT COUNT(*) AS n FROM naive_edges WHERE round_no = {round} AND done = 0"));
                if left == 0 {
                    diesel::sql_query(format!("INSERT INTO naive_fired VALUES ({round})")).execute(conn)?;
                }
                Ok::<(), diesel::result::Error>(())
            })
            .unwrap();
        },
        move |round, _| {
            let fired = count(
                &mut conn,
                &format!("SELECT COUNT(*) AS n FROM naive_fired WHERE round_no = {round}"),
            );
            record.lock().unwrap().push(fired);
        },
    );
    let fired = fired_per_round.lock().unwrap().clone();
    let never = fired.iter().filter(|n| **n == 0).count();
    let twice = fired.iter().filter(|n| **n > 1).count();
    eprintln!(
        "{backend:?} negative control: {ROUNDS} rounds, never fired in {never}, fired twice or more in {twice}"
    );
    assert_eq!(twice, 0, "a plain count cannot double-fire");
    match backend {
        Backend::Sqlite => assert_eq!(never, 0, "SQLite serializes writers"),
        _ => assert!(
            never > 0,
            "{backend:?}: the plain count never lost a release in {ROUNDS} rounds: the race test would not catch a broken lock"
        ),
    }
}

/// Rounds of a batch of 16 with all three callbacks, every job claimed, 8 threads
/// finishing two each at the same instant; in odd rounds one of them dies. After each
/// round: on_finish released, exactly one of on_success / on_failure released and the
/// other cancelled, and claiming the queue hands out each released callback once.
fn batch_callbacks_fire_exactly_once_when_the_last_jobs_finish_at_the_same_instant(
    backend: Backend,
) {
    const ROUNDS: usize = 40;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    type Round = (jobs::EnqueuedWorkflow, Vec<Vec<jobs::JobClaim>>);
    let prepare = |conn: &mut AnyConnection, round: usize| -> Round {
        let queue = format!("b{round}");
        let mut batch = Workflow::new(queue.as_str());
        for _ in 0..16 {
            batch.add(NewJob::new(queue.as_str(), "part", vec![]));
        }
        batch
            .on_success(NewJob::new(queue.as_str(), "success", vec![]))
            .on_failure(NewJob::new(queue.as_str(), "failure", vec![]))
            .on_finish(NewJob::new(queue.as_str(), "finish", vec![]));
        let made = jobs::enqueue_workflow(conn, &batch).unwrap();
        let claimed = jobs::claim(conn, &queue, 100, TTL).unwrap();
        assert_eq!(claimed.len(), 16);
        let mut shares = vec![Vec::new(); CLAIMERS];
        for (i, job) in claimed.iter().enumerate() {
            shares[i % CLAIMERS].push(job.claim());
        }
        (made, shares)
    };
    let current: Arc<Mutex<Round>> = Arc::new(Mutex::new(prepare(&mut conn, 0)));
    let shares = current.clone();
    contest(
        &db,
        CLAIMERS,
        ROUNDS,
        move |round, thread, conn| {
            let share = shares.lock().unwrap().1[thread].clone();
            if round % 2 == 1 && thread == 3 {
                jobs::fail(conn, share[0], "dies", jobs::Retry::Never).unwrap();
                jobs::complete(conn, &share[1..]).unwrap();
            } else {
                jobs::complete(conn, &share).unwrap();
            }
        },
        |round, _| {
            let made = current.lock().unwrap().0.clone();
            let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
            let failed = round % 2 == 1;
            let fired = |yes: bool| {
                if yes {
                    JobState::Waiting
                } else {
                    JobState::Cancelled
                }
            };
            assert_eq!(
                status.on_finish.unwrap().1,
                JobState::Waiting,
                "round {round}: {status:?}"
            );
            assert_eq!(
                status.on_success.unwrap().1,
                fired(!failed),
                "round {round}: {status:?}"
            );
            assert_eq!(
                status.on_failure.unwrap().1,
                fired(failed),
                "round {round}: {status:?}"
            );
            let queue = format!("b{round}");
            let callbacks = jobs::claim(&mut conn, &queue, 100, TTL).unwrap();
            assert_eq!(callbacks.len(), 2, "round {round}");
            assert!(jobs::claim(&mut conn, &queue, 100, TTL).unwrap().is_empty());
            if round + 1 < ROUNDS {
                *current.lock().unwrap() = prepare(&mut conn, round + 1);
            }
        },
    );
}

/// A batch of 200 with callbacks; a "worker" claims 40 of them and dies (its claims are
/// left to lapse); 8 claimers drain the rest, rescuing as they go. Every part completes
/// (the killed claims are rescued and run again), on_success and on_finish run exactly
/// once, on_failure is cancelled, and no call failed.
fn batch_callbacks_fire_once_when_a_killed_workers_claims_are_rescued(backend: Backend) {
    const PARTS: usize = 200;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut batch = Workflow::new("rescued");
    for i in 0..PARTS {
        batch.add(NewJob::json("rescued", "part", &i).unwrap());
    }
    batch
        .on_success(NewJob::new("rescued", "success", vec![]))
        .on_failure(NewJob::new("rescued", "failure", vec![]))
        .on_finish(NewJob::new("rescued", "finish", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &batch).unwrap();
    let killed = jobs::claim(&mut conn, "rescued", 40, Duration::from_millis(300)).unwrap();
    assert_eq!(killed.len(), 40);
    let drained = drain(&db, "rescued", PARTS + 2, move |conn, _| {
        // Rescues race the other claimers' claims and completions.
        jobs::rescue(conn, 100).unwrap();
        None
    });
    assert!(
        drained.errors.is_empty(),
        "{backend:?} errors: {:?}",
        drained.errors
    );
    let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
    assert_eq!(status.counts.completed, PARTS as i64, "{status:?}");
    assert_eq!(status.on_success.unwrap().1, JobState::Completed);
    assert_eq!(status.on_finish.unwrap().1, JobState::Completed);
    assert_eq!(status.on_failure.unwrap().1, JobState::Cancelled);
    for callback in [made.on_success.unwrap(), made.on_finish.unwrap()] {
        assert_eq!(drained.runs.get(&callback), Some(&1));
    }
    for job in &killed {
        assert_eq!(
            drained.runs.get(&job.id),
            Some(&1),
            "killed claim {} not run again once",
            job.id
        );
    }
}

/// Rounds of: thread 0 completes a running job X while thread 1 enqueues a job depending
/// on X, at the same instant. Whichever commits first, the dependent ends waiting (the
/// enqueue locks X, so X's completion either sees the new edge or finished before the
/// enqueue read X as completed): never left blocked.
fn a_dependent_enqueued_while_its_dependency_completes_is_never_left_blocked(backend: Backend) {
    const ROUNDS: usize = 60;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let prepare = |conn: &mut AnyConnection, round: usize| {
        let queue = format!("e{round}");
        jobs::enqueue(conn, &NewJob::new(queue.as_str(), "x", vec![])).unwrap();
        jobs::claim(conn, &queue, 1, TTL).unwrap().remove(0)
    };
    let current = Arc::new(Mutex::new(prepare(&mut conn, 0)));
    let shared = current.clone();
    let dependents = Arc::new(Mutex::new(Vec::new()));
    let made = dependents.clone();
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, conn| {
            let x = shared.lock().unwrap().clone();
            if thread == 0 {
                assert_eq!(
                    jobs::complete(conn, &[x.claim()]).unwrap(),
                    vec![Outcome::Done]
                );
            } else {
                let queue = format!("e{round}");
                let id = jobs::enqueue(
                    conn,
                    &NewJob::new(queue.as_str(), "after", vec![]).depends_on([x.id]),
                )
                .unwrap()
                .id;
                made.lock().unwrap().push(id);
            }
        },
        |round, _| {
            let id = *dependents.lock().unwrap().last().unwrap();
            assert_eq!(
                jobs::get(&mut conn, id).unwrap().unwrap().state,
                JobState::Waiting,
                "{backend:?} round {round}"
            );
            if round + 1 < ROUNDS {
                *current.lock().unwrap() = prepare(&mut conn, round + 1);
            }
        },
    );
}

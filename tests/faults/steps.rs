//! Durable steps under SIGKILL: a handler of 5 steps, each writing a row of a user table in
//! its closure, whose worker process is killed at random points over many rounds (and
//! started again): every step's write lands exactly once per job, and no step that
//! completed before a kill runs again. The negative control, the same handler writing in
//! plain transactions without steps, shows the re-runs (so the harness can see them).

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, Backoff, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::child::{spawn, sql};
use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    killed_workers_run_each_step_once,
    negative_control_killed_workers_without_steps_run_writes_again,
);

const JOBS: usize = 24;
const STEPS: usize = 5;
/// Worker processes killed per test.
const KILLS: usize = 20;

/// A worker process of this scenario: 4 threads on queue "steps", kind "five": 5 steps, each
/// appending "job step token" to the run log (a file, so that a SIGKILL loses nothing written
/// and a step's write lock on SQLite does not stand in its way) and then writing its row of
/// `fault_step_writes`, with short pauses inside and between steps. `mode` "steps": each step
/// through `ctx.step`; "plain": each in a plain transaction (the negative control). Claims
/// last 60 s: a killed worker's jobs come back because its lock ends with it, so no run in a
/// living process ever loses its claim (a stale run could start a step's closure after
/// another run committed it, and be refused: not a re-run, but the log could not tell).
pub fn step_worker(url: &str, mode: &str, log: &str) {
    let pool = Pool::options().max_size(8).open(url).expect("pool");
    let log = std::sync::Mutex::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("the run log"),
    );
    let steps = mode == "steps";
    let writes = pool.clone();
    let _worker = Worker::builder(pool)
        .queue("steps")
        .threads(4)
        .claim_ttl(Duration::from_secs(60))
        .poll_interval(Duration::from_millis(20))
        .backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(100),
        })
        .raw_handler("five", move |ctx: &JobContext, _: &[u8]| {
            let token = ctx.claim().token.to_string();
            for step in 1..=STEPS {
                let pause = |n: u64| (ctx.id as u64 * 7919 + step as u64 * 104_729 + n) % 11;
                let closure = |conn: &mut AnyConnection| -> Result<usize, JobError> {
                    // Unbuffered, one write(2) per line: what a SIGKILL cannot lose.
                    let line = format!("{} {step} {token}\n", ctx.id);
                    log.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .write_all(line.as_bytes())?;
                    std::thread::sleep(Duration::from_millis(1 + pause(0)));
                    diesel::sql_query(sql(
                        tenure::TenureConnection::backend(conn),
                        "INSERT INTO fault_step_writes (job_id, step, token) VALUES (?, ?, ?)",
                    ))
                    .bind::<BigInt, _>(ctx.id)
                    .bind::<BigInt, _>(step as i64)
                    .bind::<Text, _>(&token)
                    .execute(conn)?;
                    Ok(step)
                };
                let done = if steps {
                    ctx.step(&format!("step-{step}"), closure)?
                } else {
                    let mut conn = writes.get()?;
                    tenure::transaction(&mut *conn, |conn| {
                        closure(conn).map_err(|e| StepFailed(e.to_string()))
                    })
                    .map_err(|e| JobError::retry(e.0))?
                };
                assert_eq!(done, step);
                std::thread::sleep(Duration::from_millis(2 + pause(1)));
            }
            Ok(())
        })
        .start()
        .expect("start the worker");
    println!("TENURE started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A plain transaction's error (the negative control's).
struct StepFailed(String);

impl From<diesel::result::Error> for StepFailed {
    fn from(e: diesel::result::Error) -> Self {
        StepFailed(e.to_string())
    }
}

/// What the rounds left: each (job, step)'s writes (their tokens, in no order) and the run
/// log's closure runs (their tokens, in the order they began).
struct Outcome {
    writes: HashMap<(i64, usize), Vec<String>>,
    runs: HashMap<(i64, usize), Vec<String>>,
    kills: usize,
    revived: usize,
}

/// Enqueues the jobs, then `KILLS` times: starts a worker process, waits until a random
/// number (1 to 8) of step writes more have committed, and SIGKILLs it; then runs a last
/// worker until every job has completed. Dead jobs (a job whose runs were killed too often
/// dies of its lapses) are revived with `retry_dead_of_kind` before each round: the revived
/// job resumes too.
fn run_rounds(backend: Backend, mode: &str) -> Outcome {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let text = if backend == Backend::Mysql {
        "VARCHAR(64)"
    } else {
        "TEXT"
    };
    conn.batch_execute(&format!(
        "CREATE TABLE fault_step_writes (job_id BIGINT NOT NULL, step BIGINT NOT NULL, token {text} NOT NULL)"
    ))
    .unwrap();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("steps", "five", vec![]).max_attempts(100))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("runs.log").display().to_string();
    let written =
        |conn: &mut AnyConnection| count(conn, "SELECT COUNT(*) AS n FROM fault_step_writes");
    let completed = |conn: &mut AnyConnection| {
        count(
            conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'",
        )
    };
    let until = Instant::now() + Duration::from_secs(240);
    let (mut kills, mut revived) = (0, 0);
    while kills < KILLS && completed(&mut conn) < JOBS as i64 {
        revived += jobs::retry_dead_of_kind(&mut conn, "steps", "five").unwrap();
        let before = written(&mut conn);
        let target = before + rand::random_range(1..=8);
        let mut worker = spawn("step-worker", &[db.url(), mode, &log]);
        assert_eq!(worker.next_report().as_deref(), Some("started"));
        poll_until(
            until.saturating_duration_since(Instant::now()),
            Duration::from_millis(2),
            || (written(&mut conn) >= target || completed(&mut conn) == JOBS as i64).then_some(()),
        )
        .unwrap_or_else(|| panic!("no progress after {kills} kills"));
        worker.signal("KILL");
        let _ = worker.child.wait();
        kills += 1;
    }
    // The last worker runs everything that is left.
    let mut worker = spawn("step-worker", &[db.url(), mode, &log]);
    assert_eq!(worker.next_report().as_deref(), Some("started"));
    poll_until(
        until.saturating_duration_since(Instant::now()),
        Duration::from_millis(50),
        || {
            revived += jobs::retry_dead_of_kind(&mut conn, "steps", "five").unwrap();
            (completed(&mut conn) == JOBS as i64).then_some(())
        },
    )
    .unwrap_or_else(|| {
        panic!(
            "{} of {JOBS} jobs completed after {kills} kills",
            completed(&mut conn)
        )
    });
    drop(worker);

    #[derive(QueryableByName)]
    struct WriteRow {
        #[diesel(sql_type = BigInt)]
        job_id: i64,
        #[diesel(sql_type = BigInt)]
        step: i64,
        #[diesel(sql_type = Text)]
        token: String,
    }
    let mut writes: HashMap<(i64, usize), Vec<String>> = HashMap::new();
    for row in diesel::sql_query("SELECT job_id, step, token FROM fault_step_writes")
        .load::<WriteRow>(&mut conn)
        .unwrap()
    {
        writes
            .entry((row.job_id, row.step as usize))
            .or_default()
            .push(row.token);
    }
    let mut runs: HashMap<(i64, usize), Vec<String>> = HashMap::new();
    for line in std::fs::read_to_string(&log).unwrap().lines() {
        let mut fields = line.split(' ');
        let (Some(job), Some(step), Some(token)) = (fields.next(), fields.next(), fields.next())
        else {
            panic!("a bad log line {line:?}");
        };
        runs.entry((job.parse().unwrap(), step.parse().unwrap()))
            .or_default()
            .push(token.to_string());
    }
    if mode == "steps" {
        // Every job's steps stored, once each, and what each run of it saw.
        for id in writes.keys().map(|(id, _)| *id) {
            assert_eq!(jobs::steps(&mut conn, id).unwrap().len(), STEPS, "job {id}");
        }
    }
    Outcome {
        writes,
        runs,
        kills,
        revived,
    }
}

/// The proof: every (job, step) has exactly one write, and after the run whose write
/// committed, no run of the job ran that step's closure again.
fn killed_workers_run_each_step_once(backend: Backend) {
    let outcome = run_rounds(backend, "steps");
    assert!(outcome.kills >= KILLS / 2, "only {} kills", outcome.kills);
    assert_eq!(
        outcome.writes.len(),
        JOBS * STEPS,
        "every step of every job wrote"
    );
    let mut duplicates = Vec::new();
    let mut reruns = Vec::new();
    // Closure runs whose writes a kill rolled back (the run died inside the step).
    let mut rolled_back = 0;
    for (key, tokens) in &outcome.writes {
        if tokens.len() != 1 {
            duplicates.push((*key, tokens.len()));
            continue;
        }
        let runs = &outcome.runs[key];
        let committed = runs
            .iter()
            .rposition(|t| *t == tokens[0])
            .unwrap_or_else(|| panic!("{key:?}: the committed run is not in the log"));
        rolled_back += committed;
        if committed + 1 != runs.len() {
            reruns.push((*key, runs.len() - committed - 1));
        }
    }
    assert!(
        duplicates.is_empty(),
        "steps written more than once: {duplicates:?}"
    );
    assert!(
        reruns.is_empty(),
        "steps run again after they completed: {reruns:?}"
    );
    eprintln!(
        "{} kills, {} revivals, {rolled_back} step runs killed mid-step and rolled back",
        outcome.kills, outcome.revived
    );
}

/// The negative control: the same handler and kills, with each step a plain transaction.
/// A killed run's completed steps run again on the retry: some (job, step) has more than one
/// write, and the log shows the runs after the first commit.
fn negative_control_killed_workers_without_steps_run_writes_again(backend: Backend) {
    let outcome = run_rounds(backend, "plain");
    let duplicated = outcome
        .writes
        .values()
        .filter(|tokens| tokens.len() > 1)
        .count();
    assert_eq!(outcome.writes.len(), JOBS * STEPS);
    assert!(
        duplicated > 0,
        "{} kills and no step written twice: the harness does not see re-runs",
        outcome.kills
    );
    eprintln!(
        "{} kills: {duplicated} steps written more than once without ctx.step",
        outcome.kills
    );
}

//! Workflows across processes: a batch's callbacks while worker processes are killed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob, Workflow};

use crate::child::{Spawned, spawn};
use crate::common::{TestDb, conformance, count};

conformance!(killed_workers_leave_a_batchs_callbacks_firing_once);

fn start_worker(url: &str) -> Spawned {
    let mut worker = spawn("worker", &[url]);
    assert_eq!(worker.next_report().as_deref(), Some("started"));
    worker
}

/// A batch of 2,000 jobs (10-50 ms each) with on_success, on_failure and on_finish, run by
/// 4 worker processes (the killed-workers role: every run writes an effect row) while one
/// of them is SIGKILLed about every second and replaced. Every part completes; on_success
/// and on_finish are released once and complete (a second effect of theirs only from a
/// killed run); on_failure is cancelled, never run; no part is run twice without a kill.
fn killed_workers_leave_a_batchs_callbacks_firing_once(backend: Backend) {
    const PARTS: usize = 2000;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let text = if backend == Backend::Mysql {
        "VARCHAR(64)"
    } else {
        "TEXT"
    };
    conn.batch_execute(&format!(
        "CREATE TABLE fault_effects (job_id BIGINT NOT NULL, token {text} NOT NULL, \
         attempt BIGINT NOT NULL, pid BIGINT NOT NULL)"
    ))
    .unwrap();
    let mut batch = Workflow::new("killed");
    for _ in 0..PARTS {
        batch.add(NewJob::new("chaos", "effect", vec![]).max_attempts(1));
    }
    batch
        .on_success(NewJob::new("chaos", "effect", vec![]))
        .on_failure(NewJob::new("chaos", "effect", vec![]))
        .on_finish(NewJob::new("chaos", "effect", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &batch).unwrap();
    let (on_success, on_failure, on_finish) = (
        made.on_success.unwrap(),
        made.on_failure.unwrap(),
        made.on_finish.unwrap(),
    );

    let mut workers: Vec<Spawned> = (0..4).map(|_| start_worker(db.url())).collect();
    let mut killed: HashSet<i64> = HashSet::new();
    let started = Instant::now();
    let limit = Duration::from_secs(240);
    let mut next_kill = Instant::now() + Duration::from_millis(800);
    loop {
        let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
        let finished = |c: Option<(i64, JobState)>| c.is_some_and(|(_, s)| s.is_final());
        if status.counts.unfinished() == 0
            && finished(status.on_success)
            && finished(status.on_finish)
        {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "unfinished after {limit:?}: {status:?}"
        );
        if Instant::now() >= next_kill && status.counts.unfinished() > 200 {
            let victim = rand::random_range(0..workers.len());
            let mut dead = workers.swap_remove(victim);
            killed.insert(dead.pid() as i64);
            let _ = dead.child.kill(); // SIGKILL
            let _ = dead.child.wait();
            workers.push(start_worker(db.url()));
            next_kill = Instant::now() + Duration::from_millis(rand::random_range(700..1300));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(workers);

    let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
    assert_eq!(status.counts.completed, PARTS as i64, "{status:?}");
    assert_eq!(status.on_success.unwrap().1, JobState::Completed);
    assert_eq!(status.on_finish.unwrap().1, JobState::Completed);
    assert_eq!(status.on_failure.unwrap().1, JobState::Cancelled);

    #[derive(QueryableByName)]
    struct Effect {
        #[diesel(sql_type = BigInt)]
        job_id: i64,
        #[diesel(sql_type = BigInt)]
        pid: i64,
    }
    let effects = diesel::sql_query("SELECT job_id, pid FROM fault_effects")
        .load::<Effect>(&mut conn)
        .unwrap();
    let mut by_job: HashMap<i64, Vec<i64>> = HashMap::new();
    for effect in &effects {
        by_job.entry(effect.job_id).or_default().push(effect.pid);
    }
    assert!(!by_job.contains_key(&on_failure), "on_failure ran");
    for (job, pids) in &by_job {
        let killed_runs = pids.iter().filter(|pid| killed.contains(pid)).count();
        assert!(
            killed_runs >= pids.len() - 1,
            "job {job} ran {} times with {killed_runs} killed runs",
            pids.len()
        );
    }
    for callback in [on_success, on_finish] {
        assert!(
            by_job.contains_key(&callback),
            "callback {callback} never ran"
        );
    }
    assert_eq!(by_job.len(), PARTS + 2);
    let lapsed = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses > 0",
    );
    println!(
        "{backend}: batch of {PARTS} with callbacks, {} workers killed, {lapsed} jobs rescued after a kill; callbacks fired once",
        killed.len()
    );
}

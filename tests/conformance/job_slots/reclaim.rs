//! PostgreSQL's retention by slot (`jobs::reclaim_job_slots`, tenure-0056's
//! `tenure_reclaim_job_slot`): a slot other than the current one whose jobs the policies would
//! all delete is truncated with their rows beside it; a slot holding one job the policies keep
//! (waiting, running, another queue's, inside its policy's age, needed by a dependent) stays
//! whole, however claims, finishes and dependents' enqueues race it. (MariaDB and SQLite keep
//! one table: it returns 0 there, proven by its doctest.)

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::jobs::{self, Finished, JobResult, NewJob, Outcome, Retention, Retry};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

use super::{delete_all, pages, slot_of};

const TTL: Duration = Duration::from_secs(60);

fn rows_beside(conn: &mut AnyConnection, ids: &[i64]) -> i64 {
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    [
        "tenure_job_errors WHERE job_id",
        "tenure_job_outputs WHERE job_id",
        "tenure_job_results WHERE job_id",
        "tenure_job_limits WHERE job_id",
        "tenure_job_dependencies WHERE depends_on",
        "tenure_job_dependencies WHERE job_id",
    ]
    .iter()
    .map(|t| count(conn, &format!("SELECT COUNT(*) AS n FROM {t} IN ({list})")))
    .sum()
}

fn run_one(conn: &mut AnyConnection, queue: &str) -> jobs::ClaimedJob {
    jobs::claim(conn, queue, 1, TTL).unwrap().remove(0)
}

/// Finished jobs of every kind (a result, an output, an error history, a limit, a
/// dependency) fill slot 0; each thing the policies keep holds the slot in turn, and once
/// nothing does, the slot is truncated with every row beside its jobs.
#[test]
fn postgres_a_slot_goes_whole_only_once_retention_would_delete_every_job_in_it() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let enqueue = |conn: &mut AnyConnection, job: NewJob| jobs::enqueue(conn, &job).unwrap().id;
    let with_result = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let claimed = run_one(&mut conn, "q");
    jobs::complete_with_result(&mut conn, claimed.claim(), &JobResult::json(&7).unwrap()).unwrap();
    let failed = enqueue(&mut conn, NewJob::new("q", "a", vec![]).max_attempts(2));
    let claimed = run_one(&mut conn, "q");
    jobs::record_output(&mut conn, failed, 1, Some(1), b"out").unwrap();
    jobs::fail(
        &mut conn,
        claimed.claim(),
        "first",
        Retry::After(Duration::ZERO),
    )
    .unwrap();
    let claimed = run_one(&mut conn, "q");
    jobs::fail(&mut conn, claimed.claim(), "second", Retry::Never).unwrap();
    let limited = enqueue(&mut conn, NewJob::new("q", "a", vec![]).limit("k", 1));
    let claimed = run_one(&mut conn, "q");
    jobs::complete(&mut conn, &[claimed.claim()]).unwrap();
    let parent = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let child = enqueue(
        &mut conn,
        NewJob::new("q", "b", vec![]).depends_on([parent]),
    );
    let claimed = run_one(&mut conn, "q");
    assert_eq!(claimed.id, parent);
    jobs::complete(&mut conn, &[claimed.claim()]).unwrap();
    let other_queue = enqueue(&mut conn, NewJob::new("other", "a", vec![]));
    let ids = [with_result, failed, limited, parent, child, other_queue];
    for id in ids {
        assert_eq!(slot_of(&mut conn, id), 0);
    }
    assert!(rows_beside(&mut conn, &ids) > 0);

    // The current slot never goes, whatever it holds.
    assert_eq!(
        jobs::reclaim_job_slots(&mut conn, &delete_all(&["q", "other"]))
            .unwrap()
            .slots,
        0
    );
    assert_eq!(
        jobs::rotate_job_slots(&mut conn, Duration::ZERO).unwrap(),
        Some(1)
    );
    let reclaim = |conn: &mut AnyConnection, queues: &[&str]| {
        jobs::reclaim_job_slots(conn, &delete_all(queues))
            .unwrap()
            .slots
    };
    // The child is waiting (its parent completed): it holds the slot, and so its parent.
    assert_eq!(reclaim(&mut conn, &["q", "other"]), 0);
    let claimed = run_one(&mut conn, "q");
    assert_eq!(claimed.id, child);
    assert_eq!(
        reclaim(&mut conn, &["q", "other"]),
        0,
        "running, it holds the slot"
    );
    jobs::complete(&mut conn, &[claimed.claim()]).unwrap();
    // A waiting job of a queue no policy names holds it.
    assert_eq!(reclaim(&mut conn, &["q"]), 0);
    let claimed = run_one(&mut conn, "other");
    jobs::complete(&mut conn, &[claimed.claim()]).unwrap();
    assert_eq!(
        reclaim(&mut conn, &["q"]),
        0,
        "a finished job no policy names"
    );
    // A policy that keeps the dead job: it holds the slot.
    let mut keeps_dead = delete_all(&["q", "other"]);
    keeps_dead.retain(|(_, f, _)| *f != Finished::Dead);
    assert_eq!(
        jobs::reclaim_job_slots(&mut conn, &keeps_dead)
            .unwrap()
            .slots,
        0
    );
    let mut young = delete_all(&["q", "other"]);
    young[0].2 = Retention::KeepYoungerThan(Duration::from_secs(3600));
    assert_eq!(jobs::reclaim_job_slots(&mut conn, &young).unwrap().slots, 0);
    let mut newest = delete_all(&["q", "other"]);
    newest[0].2 = Retention::KeepNewest(1);
    assert_eq!(
        jobs::reclaim_job_slots(&mut conn, &newest).unwrap().slots,
        0
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 6);

    // Nothing keeps any: the slot goes, with every row beside its jobs, the current one stays.
    assert!(pages(&mut conn, 0) > 0);
    let mut went = jobs::reclaim_job_slots(&mut conn, &delete_all(&["q", "other"])).unwrap();
    went.jobs.sort();
    // What went, by queue: a worker reports it as pruned.
    assert_eq!(
        went,
        jobs::ReclaimedSlots {
            slots: 1,
            jobs: vec![("other".to_string(), 1), ("q".to_string(), 5)],
        }
    );
    assert_eq!(pages(&mut conn, 0), 0);
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_eq!(rows_beside(&mut conn, &ids), 0);
    assert_eq!(jobs::result(&mut conn, with_result).unwrap(), None);
    // Truncated once: a slot nothing was written to since is left alone.
    assert_eq!(reclaim(&mut conn, &["q", "other"]), 0);
    // New jobs go on in slot 1, and the rotation turns onto the truncated slot.
    let next = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    assert_eq!(slot_of(&mut conn, next), 1);
    assert_eq!(
        jobs::rotate_job_slots(&mut conn, Duration::ZERO).unwrap(),
        Some(2)
    );
}

/// Producers enqueue (some jobs depending on jobs just completed), claimers claim and finish
/// on their own connections, while a reclaimer truncates every slot it may and a rotator
/// turns the slots as fast as they go, with a policy that deletes every finished job: every
/// job enqueued is claimed exactly once, every finish of a claim is done (never lost), and no
/// dependent is left blocked.
#[test]
fn postgres_reclaims_racing_claims_finishes_and_dependents_lose_nothing() {
    let db = TestDb::migrated(Backend::Postgres);
    let stop = Arc::new(AtomicBool::new(false));
    let enqueued = Arc::new(Mutex::new(HashSet::new()));
    let claimed = Arc::new(Mutex::new(Vec::new()));
    let completed_recently = Arc::new(Mutex::new(Vec::<i64>::new()));
    let reclaimed = Arc::new(Mutex::new(0usize));
    let mut threads = Vec::new();
    for producer in 0..2 {
        let (mut conn, stop, enqueued, recent) = (
            db.connect(),
            stop.clone(),
            enqueued.clone(),
            completed_recently.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let mut job = NewJob::new("q", "a", vec![]);
                // Some jobs depend on a job completed a moment ago (few: a slot holding one
                // whose dependent has not run yet is held whole): the reclaimer may
                // be truncating its slot right then. Refused (no such job) or accepted and
                // then run: never blocked for good.
                if producer == 1 && n % 40 == 0 {
                    let dependency = recent.lock().unwrap().pop();
                    if let Some(dependency) = dependency {
                        job = job.depends_on([dependency]);
                    }
                }
                match jobs::enqueue(&mut conn, &job) {
                    Ok(done) => {
                        enqueued.lock().unwrap().insert(done.id);
                    }
                    Err(tenure::Error::InvalidInput { .. }) => {}
                    Err(e) => panic!("enqueue: {e}"),
                }
            }
        }));
    }
    for _ in 0..2 {
        let (mut conn, stop, claimed, recent) = (
            db.connect(),
            stop.clone(),
            claimed.clone(),
            completed_recently.clone(),
        );
        threads.push(std::thread::spawn(move || {
            loop {
                let stopping = stop.load(Ordering::Relaxed);
                let batch = jobs::claim(&mut conn, "q", 20, TTL).unwrap();
                if batch.is_empty() {
                    if stopping {
                        return;
                    }
                    continue;
                }
                // Running across a rotation or two, with a backlog waiting behind them.
                std::thread::sleep(Duration::from_millis(3));
                let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
                let done = jobs::complete(&mut conn, &claims).unwrap();
                assert!(
                    done.iter().all(|o| *o == Outcome::Done),
                    "a finish of a claim was lost: {done:?}"
                );
                claimed.lock().unwrap().extend(batch.iter().map(|j| j.id));
                let mut recent = recent.lock().unwrap();
                recent.extend(batch.iter().map(|j| j.id));
                let keep_from = recent.len().saturating_sub(50);
                recent.drain(..keep_from);
            }
        }));
    }
    {
        let (mut conn, stop, reclaimed) = (db.connect(), stop.clone(), reclaimed.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                jobs::rotate_job_slots(&mut conn, Duration::ZERO).unwrap();
                *reclaimed.lock().unwrap() +=
                    jobs::reclaim_job_slots(&mut conn, &delete_all(&["q"]))
                        .unwrap()
                        .slots;
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(8));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    let mut conn = db.connect();
    // What the claimers left: jobs released by a dependency after their last claim.
    loop {
        let batch = jobs::claim(&mut conn, "q", 100, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
        let done = jobs::complete(&mut conn, &claims).unwrap();
        assert!(done.iter().all(|o| *o == Outcome::Done), "{done:?}");
        claimed.lock().unwrap().extend(batch.iter().map(|j| j.id));
    }
    let claimed = claimed.lock().unwrap();
    let unique: HashSet<i64> = claimed.iter().copied().collect();
    assert_eq!(unique.len(), claimed.len(), "a job was claimed twice");
    let enqueued = enqueued.lock().unwrap();
    let never: Vec<_> = enqueued.difference(&unique).take(10).collect();
    assert!(never.is_empty(), "jobs never claimed: {never:?}");
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'blocked'"
        ),
        0
    );
    let reclaimed = *reclaimed.lock().unwrap();
    let dependents = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_job_dependencies",
    );
    eprintln!(
        "{} enqueued, {reclaimed} slots reclaimed, {dependents} edges left",
        enqueued.len()
    );
    assert!(reclaimed >= 3, "the race must truncate slots: {reclaimed}");
    assert!(enqueued.len() > 1_000, "{}", enqueued.len());
}

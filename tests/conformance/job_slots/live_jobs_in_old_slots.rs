//! Live jobs in an old slot outlive the reclaims around them (PostgreSQL's job slots): a
//! parked job, a running job's durable steps, a failed job waiting for its retry, a snoozed
//! job, a dependency's result read by a dependent in a later slot, a workflow spanning slots:
//! none is taken, nor any row beside it, until its slot's last job may go; then the slot goes
//! with every row beside its jobs. (A helper's attacks; all passed when written.)

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, JobResult, JobState, NewJob, Outcome, Retry, Workflow};

use crate::common::{TestDb, count};

use super::{churn, current_slot, deadlocks, delete_all, pages, rotate, slot_of};

const TTL: Duration = Duration::from_secs(60);

/// Attacks: what retention must keep in an old slot while a reclaimer and rotator spin
/// (DeleteAll of the queue) beside it: a job enqueued parked (and its `tenure_parked` row), a
/// running job with a durable step stored (`tenure_steps`), a job that failed with a step
/// stored and waits for its retry, a snoozed job, a completed job with a result whose
/// dependent sits in a later slot, among 200 completed jobs. While the churn runs, each is
/// used: the parked job resumed, claimed and completed; the retried and snoozed jobs claimed
/// again (the retried job's step read back, its closure not run), the running job's step read
/// back and its claim completed `Done`, the dependent's `dependency_results` read and it
/// completed. Three rounds. Then the slot must go with nothing beside it left.
///
/// FOUND: PASSES.
#[test]
fn postgres_parked_steps_retries_snoozes_and_dependencies_in_an_old_slot_survive_reclaims() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    for round in 0..3 {
        let slot = current_slot(&mut conn);
        let parked = jobs::enqueue_parked(
            &mut conn,
            &NewJob::new("p", "parked", vec![]),
            Duration::from_secs(3600),
        )
        .unwrap();
        let running = jobs::enqueue(&mut conn, &NewJob::new("p", "running", vec![]))
            .unwrap()
            .id;
        let run = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(run.id, running);
        let v: i32 = jobs::run_step(&mut conn, run.claim(), "s", |_| Ok::<_, String>(41)).unwrap();
        assert_eq!(v, 41);
        let retried = jobs::enqueue(
            &mut conn,
            &NewJob::new("p", "retried", vec![]).max_attempts(3),
        )
        .unwrap()
        .id;
        let r = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(r.id, retried);
        let _: i32 = jobs::run_step(&mut conn, r.claim(), "s", |_| Ok::<_, String>(7)).unwrap();
        assert_eq!(
            jobs::fail(
                &mut conn,
                r.claim(),
                "boom",
                Retry::After(Duration::from_millis(1500))
            )
            .unwrap(),
            Outcome::Done
        );
        let snoozed = jobs::enqueue(&mut conn, &NewJob::new("p", "snoozed", vec![]))
            .unwrap()
            .id;
        let s = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(s.id, snoozed);
        assert_eq!(
            jobs::snooze(&mut conn, s.claim(), Duration::from_millis(1500)).unwrap(),
            Outcome::Done
        );
        let with_result = jobs::enqueue(&mut conn, &NewJob::new("p", "result", vec![]))
            .unwrap()
            .id;
        let w = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(w.id, with_result);
        jobs::complete_with_result(&mut conn, w.claim(), &JobResult::json(&round).unwrap())
            .unwrap();
        let batch: Vec<NewJob> = (0..200)
            .map(|_| NewJob::new("p", "filler", vec![]))
            .collect();
        jobs::enqueue_many(&mut conn, &batch).unwrap();
        loop {
            let got = jobs::claim_kinds(&mut conn, "p", &["filler"], 100, TTL).unwrap();
            if got.is_empty() {
                break;
            }
            let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
            jobs::complete(&mut conn, &claims).unwrap();
        }
        let ids = [parked.id, running, retried, snoozed, with_result];
        for id in ids {
            assert_eq!(slot_of(&mut conn, id), slot, "round {round}: job {id}");
        }
        assert!(rotate(&mut conn).is_some(), "round {round}: no rotation");
        let dependent = jobs::enqueue(
            &mut conn,
            &NewJob::new("p", "dependent", vec![]).depends_on([with_result]),
        )
        .unwrap()
        .id;
        assert_ne!(slot_of(&mut conn, dependent), slot);

        let stop = Arc::new(AtomicBool::new(false));
        let churner = churn(db.url().to_string(), &["p"], true, stop.clone());
        std::thread::sleep(Duration::from_millis(1_600));
        let mut seen = Vec::new();
        for id in ids {
            let present = count(
                &mut conn,
                &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id}"),
            );
            seen.push((id, present));
        }
        let parked_rows = count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_parked WHERE job_id = {}",
                parked.id
            ),
        );
        let step_rows = count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_steps WHERE job_id IN ({running}, {retried})"
            ),
        );
        let result_rows = count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_job_results WHERE job_id = {with_result}"),
        );
        eprintln!(
            "round {round}: slot {slot}: present {seen:?}, parked rows {parked_rows}, steps {step_rows}, results {result_rows}"
        );
        assert!(
            seen.iter().all(|(_, n)| *n == 1),
            "round {round}: lost {seen:?}"
        );
        assert_eq!(
            (parked_rows, step_rows, result_rows),
            (1, 2, 1),
            "round {round}"
        );

        // Use each while the churn goes on.
        assert_eq!(
            jobs::resume_parked(&mut conn, &parked.token, None).unwrap(),
            jobs::ParkedOutcome::Applied
        );
        let step_again: i32 =
            jobs::run_step(&mut conn, run.claim(), "s", |_| Ok::<_, String>(-1)).unwrap();
        assert_eq!(step_again, 41, "round {round}: the running job's step");
        assert_eq!(
            jobs::complete(&mut conn, &[run.claim()]).unwrap(),
            vec![Outcome::Done]
        );
        let inputs = jobs::dependency_results(&mut conn, dependent).unwrap();
        assert_eq!(inputs.len(), 1, "round {round}");
        assert_eq!(
            inputs[0]
                .result
                .as_ref()
                .map(|r| r.decode::<i32>().unwrap()),
            Some(round),
            "round {round}: the dependency's result"
        );
        let mut left: HashSet<i64> = [parked.id, retried, snoozed, dependent].into();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut bad = Vec::new();
        while !left.is_empty() && Instant::now() < deadline {
            for j in jobs::claim(&mut conn, "p", 10, TTL).unwrap() {
                if j.id == retried {
                    let v: i32 =
                        jobs::run_step(&mut conn, j.claim(), "s", |_| Ok::<_, String>(-1)).unwrap();
                    if v != 7 {
                        bad.push(format!("retried job's step read {v}"));
                    }
                }
                if j.id == dependent {
                    let inputs = jobs::dependency_results(&mut conn, dependent).unwrap();
                    if inputs.len() != 1
                        || inputs[0].state != JobState::Completed
                        || inputs[0].result.is_none()
                    {
                        bad.push(format!("dependent's inputs while running: {inputs:?}"));
                    }
                }
                let o = jobs::complete(&mut conn, &[j.claim()]).unwrap()[0];
                if o != Outcome::Done {
                    bad.push(format!("job {}: {o:?}", j.id));
                }
                left.remove(&j.id);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        let (reclaimed, rotations, errors) = churner.join().unwrap();
        eprintln!(
            "round {round}: left {left:?}, bad {bad:?}, reclaimed {reclaimed}, rotations {rotations}, errors {errors:?}"
        );
        assert!(
            left.is_empty(),
            "round {round}: never claimed again: {left:?}"
        );
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        // Now all may go: the slot, and nothing beside its jobs stays.
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["p"]))
            .unwrap()
            .slots
            > 0
        {}
        assert_eq!(pages(&mut conn, slot), 0, "round {round}: slot {slot} left");
        let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        for t in [
            "tenure_parked",
            "tenure_steps",
            "tenure_job_results",
            "tenure_job_errors",
        ] {
            assert_eq!(
                count(
                    &mut conn,
                    &format!("SELECT COUNT(*) AS n FROM {t} WHERE job_id IN ({list})")
                ),
                0,
                "round {round}: {t} left beside the reclaimed slot"
            );
        }
    }
    assert_eq!(deadlocks(&mut conn), 0);
}

/// Attacks: a workflow whose jobs span slots (two steps and an on_success callback in slot s;
/// after a rotation, a job depending on the first step, which joins the workflow, in a later
/// slot), run to the end while a reclaimer and rotator spin (DeleteAll): the steps must stay
/// while the callback and the late dependent are unfinished; the callback released once; the
/// workflow's row must stay while any of its jobs is left, and go (no orphan) once all its
/// slots are reclaimed. Three rounds.
///
/// FOUND: PASSES.
#[test]
fn postgres_a_workflow_spanning_slots_stays_whole_until_its_last_slot_goes() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    for round in 0..3 {
        let mut wf = Workflow::new("span");
        let a = wf.add(NewJob::new("w", "a", vec![]));
        wf.add(NewJob::new("w", "b", vec![]));
        let _ = a;
        wf.on_success(NewJob::new("w", "done", vec![]));
        let made = jobs::enqueue_workflow(&mut conn, &wf).unwrap();
        let first_slot = slot_of(&mut conn, made.jobs[0]);
        // Filler so the slot has something to reclaim besides the workflow.
        let batch: Vec<NewJob> = (0..100)
            .map(|_| NewJob::new("w", "filler", vec![]))
            .collect();
        jobs::enqueue_many(&mut conn, &batch).unwrap();
        loop {
            let got = jobs::claim_kinds(&mut conn, "w", &["filler"], 100, TTL).unwrap();
            if got.is_empty() {
                break;
            }
            let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
            jobs::complete(&mut conn, &claims).unwrap();
        }
        assert!(rotate(&mut conn).is_some(), "round {round}: no rotation");
        let late = jobs::enqueue(
            &mut conn,
            &NewJob::new("w", "late", vec![]).depends_on([made.jobs[0]]),
        )
        .unwrap()
        .id;
        assert_ne!(slot_of(&mut conn, late), first_slot);
        assert_eq!(
            jobs::get(&mut conn, late).unwrap().unwrap().workflow_id,
            Some(made.id)
        );

        let stop = Arc::new(AtomicBool::new(false));
        let churner = churn(db.url().to_string(), &["w"], true, stop.clone());
        let callback = made.on_success.unwrap();
        let mut done = Vec::new();
        let mut bad = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while done.len() < 4 && Instant::now() < deadline {
            for j in jobs::claim_kinds(&mut conn, "w", &["a", "b", "done", "late"], 1, TTL).unwrap()
            {
                if j.id == late || j.id == callback {
                    let inputs = jobs::dependency_results(&mut conn, j.id).unwrap();
                    if inputs.iter().any(|i| i.state != JobState::Completed) || inputs.is_empty() {
                        bad.push(format!("{}'s inputs: {inputs:?}", j.kind));
                    }
                }
                let o = jobs::complete(&mut conn, &[j.claim()]).unwrap()[0];
                if o != Outcome::Done {
                    bad.push(format!("{}: {o:?}", j.kind));
                }
                done.push(j.id);
                // While any job of it is left, the workflow is there.
                if done.len() < 4 && jobs::workflow_status(&mut conn, made.id).unwrap().is_none() {
                    bad.push(format!("workflow gone after {done:?}"));
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (reclaimed, rotations, errors) = churner.join().unwrap();
        eprintln!(
            "round {round}: done {done:?}, bad {bad:?}, reclaimed {reclaimed}, rotations {rotations}, errors {errors:?}"
        );
        assert_eq!(done.len(), 4, "round {round}: {done:?}");
        let unique: HashSet<_> = done.iter().collect();
        assert_eq!(unique.len(), 4, "round {round}: a job ran twice: {done:?}");
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        // Every slot of it goes; then the workflow's row and its edges go too.
        for _ in 0..6 {
            while jobs::reclaim_job_slots(&mut conn, &delete_all(&["w"]))
                .unwrap()
                .slots
                > 0
            {}
            rotate(&mut conn);
        }
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["w"]))
            .unwrap()
            .slots
            > 0
        {}
        let jobs_left = count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE workflow_id = {}",
                made.id
            ),
        );
        let wf_rows = count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_workflows WHERE id = {}",
                made.id
            ),
        );
        let orphan_edges = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_job_dependencies d WHERE NOT EXISTS \
             (SELECT 1 FROM tenure_jobs j WHERE j.id = d.job_id) \
             OR NOT EXISTS (SELECT 1 FROM tenure_jobs j WHERE j.id = d.depends_on)",
        );
        let orphan_stripes = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_dependency_stripes s WHERE NOT EXISTS \
             (SELECT 1 FROM tenure_jobs j WHERE j.id = s.job_id)",
        );
        let orphan_results = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_job_results r WHERE NOT EXISTS \
             (SELECT 1 FROM tenure_jobs j WHERE j.id = r.job_id)",
        );
        eprintln!(
            "round {round}: jobs left {jobs_left}, workflow rows {wf_rows}, orphan edges {orphan_edges}, stripes {orphan_stripes}, results {orphan_results}"
        );
        assert_eq!(
            (jobs_left > 0, wf_rows),
            (jobs_left > 0, i64::from(jobs_left > 0)),
            "round {round}: a workflow row without jobs, or jobs without their workflow"
        );
        assert_eq!(
            (orphan_edges, orphan_stripes, orphan_results),
            (0, 0, 0),
            "round {round}"
        );
    }
    assert_eq!(deadlocks(&mut conn), 0);
}

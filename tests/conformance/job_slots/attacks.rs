//! A helper's attacks on PostgreSQL's job slots and retention by slot (not attacked before):
//! bulks by COPY whose slot was read before a rotation or a reclaim, rescue and cancel racing
//! the reclaim of their job's slot, parked jobs, durable steps, retries and snoozes in an old
//! slot, a dependency's result read by a dependent in a later slot, a workflow spanning slots.
//! Each test's doc comment says what it attacks and what was found.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenure::jobs::{self, JobResult, JobState, NewJob, Outcome, Retry, Workflow};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

use super::{delete_all, pages, rotate, slot_of};

const TTL: Duration = Duration::from_secs(60);

fn current_slot(conn: &mut AnyConnection) -> i64 {
    count(
        conn,
        "SELECT pg_sequence_last_value('tenure_jobs_slot')::bigint AS n",
    )
}

/// The server's count of deadlocks in this database, read until it settles.
fn deadlocks(conn: &mut AnyConnection) -> i64 {
    let mut n = 0;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        n = n.max(count(
            conn,
            "SELECT deadlocks AS n FROM pg_stat_database WHERE datname = current_database()",
        ));
    }
    n
}

/// A thread that reclaims (DeleteAll of `queues`) and, if `rotating`, rotates as fast as it
/// can until `stop`: (reclaimed slots, rotations, errors seen).
fn churn(
    url: String,
    queues: &'static [&'static str],
    rotating: bool,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(usize, usize, Vec<String>)> {
    std::thread::spawn(move || {
        let mut c = AnyConnection::connect(&url).unwrap();
        let (mut reclaimed, mut rotations, mut errors) = (0, 0, Vec::new());
        while !stop.load(Ordering::Relaxed) {
            match jobs::reclaim_job_slots(&mut c, &delete_all(queues)) {
                Ok(r) => reclaimed += r.slots,
                Err(e) => errors.push(format!("reclaim: {e}")),
            }
            if rotating {
                match jobs::rotate_job_slots(&mut c, Duration::ZERO) {
                    Ok(Some(_)) => rotations += 1,
                    Ok(None) => {}
                    Err(e) => errors.push(format!("rotate: {e}")),
                }
            }
        }
        (reclaimed, rotations, errors)
    })
}

/// Attacks: bulks by COPY (`enqueue_many` of 64 to 2,000 plain jobs; the START statement reads
/// the current slot, then the ids are taken and the rows built, then COPY names that slot's
/// partition) while one thread reclaims (DeleteAll) and rotates as fast as it goes and two
/// claimers drain, so that slots turn and are truncated between a bulk's START and its COPY.
/// Three producers, each bulk's ids recorded; every job must be claimed exactly once, every
/// complete `Done`, nothing left waiting, no deadlock counted by the server.
///
/// FOUND: PASSES (see the report: bulks landed in slots that were no longer current, and
/// were held there until drained; none lost or truncated, each claimed once).
#[test]
fn postgres_bulk_copies_racing_rotations_and_reclaims_lose_no_job() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let stop = Arc::new(AtomicBool::new(false));
    let producing = Arc::new(AtomicUsize::new(3));
    let enqueued: Arc<Mutex<Vec<i64>>> = Arc::default();
    let claimed: Arc<Mutex<Vec<i64>>> = Arc::default();
    let bad_outcomes: Arc<Mutex<Vec<String>>> = Arc::default();
    let off_current = Arc::new(AtomicUsize::new(0));
    let churner = churn(db.url().to_string(), &["b"], true, stop.clone());
    let producers: Vec<_> = (0..3)
        .map(|p| {
            let url = db.url().to_string();
            let (enqueued, producing, off_current) =
                (enqueued.clone(), producing.clone(), off_current.clone());
            std::thread::spawn(move || {
                let mut c = AnyConnection::connect(&url).unwrap();
                for round in 0..14 {
                    let n = if round % 2 == 0 { 64 + round } else { 1_500 + 37 * p };
                    let batch: Vec<NewJob> = (0..n)
                        .map(|i| NewJob::new("b", "bulk", format!("{p}/{round}/{i}").into_bytes()))
                        .collect();
                    let ids: Vec<i64> = jobs::enqueue_many(&mut c, &batch)
                        .unwrap()
                        .into_iter()
                        .map(|e| e.id)
                        .collect();
                    assert_eq!(ids.len(), n);
                    let first = ids[0];
                    let slot = count(
                        &mut c,
                        &format!(
                            "SELECT coalesce((SELECT slot::bigint FROM tenure_jobs WHERE id = {first}), -9) AS n"
                        ),
                    );
                    if slot != -9 && slot != current_slot(&mut c) {
                        off_current.fetch_add(1, Ordering::Relaxed);
                    }
                    enqueued.lock().unwrap().extend(ids);
                }
                producing.fetch_sub(1, Ordering::Relaxed);
            })
        })
        .collect();
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let url = db.url().to_string();
            let (claimed, producing, enqueued, bad) = (
                claimed.clone(),
                producing.clone(),
                enqueued.clone(),
                bad_outcomes.clone(),
            );
            std::thread::spawn(move || {
                let mut c = AnyConnection::connect(&url).unwrap();
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let got = jobs::claim(&mut c, "b", 200, TTL).unwrap();
                    if got.is_empty() {
                        let done = producing.load(Ordering::Relaxed) == 0
                            && claimed.lock().unwrap().len() >= enqueued.lock().unwrap().len();
                        if done || Instant::now() > deadline {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
                    let outcomes = jobs::complete(&mut c, &claims).unwrap();
                    for (j, o) in got.iter().zip(&outcomes) {
                        if *o != Outcome::Done {
                            bad.lock().unwrap().push(format!("job {}: {o:?}", j.id));
                        }
                    }
                    claimed.lock().unwrap().extend(got.iter().map(|j| j.id));
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    for c in claimers {
        c.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (reclaimed, rotations, errors) = churner.join().unwrap();
    let enqueued = enqueued.lock().unwrap().clone();
    let claimed = claimed.lock().unwrap().clone();
    let mut times: HashMap<i64, usize> = HashMap::new();
    for id in &claimed {
        *times.entry(*id).or_default() += 1;
    }
    let twice: Vec<_> = times.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).collect();
    let set: HashSet<i64> = claimed.iter().copied().collect();
    let never: Vec<i64> = enqueued.iter().copied().filter(|id| !set.contains(id)).collect();
    let never_present = never
        .iter()
        .filter(|id| count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id}")) > 0)
        .count();
    let waiting = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'",
    );
    let dl = deadlocks(&mut conn);
    eprintln!(
        "enqueued {}, claimed {}, twice {}, never claimed {} (of which still in the table {}), \
         waiting {waiting}, bulks off the current slot {}, reclaimed {reclaimed}, rotations \
         {rotations}, errors {errors:?}, bad outcomes {:?}, deadlocks {dl}",
        enqueued.len(),
        claimed.len(),
        twice.len(),
        never.len(),
        never_present,
        off_current.load(Ordering::Relaxed),
        bad_outcomes.lock().unwrap()
    );
    assert!(rotations > 3 && reclaimed > 3, "too little churn to prove anything");
    assert!(errors.is_empty(), "{errors:?}");
    assert!(twice.is_empty(), "claimed twice: {twice:?}");
    assert!(never.is_empty(), "{} jobs never claimed: {:?}", never.len(), &never[..never.len().min(20)]);
    assert_eq!(waiting, 0);
    assert!(bad_outcomes.lock().unwrap().is_empty());
    assert_eq!(dl, 0);
}

/// Attacks: `jobs::rescue` and `jobs::cancel` racing the reclaim of their jobs' slot. Each
/// round: 300 jobs in the current slot; 30 claimed with a 1-second ttl (to lapse), 30 left
/// waiting (to be cancelled), the rest completed; a rotation leaves the slot behind; then a
/// thread reclaims (DeleteAll) and rotates without pause, a canceller cancels the 30 waiting
/// jobs, and once the claims lapsed a rescuer returns them while a claimer takes them again
/// and completes them; meanwhile the old, lapsed claims' completes are tried too (`Lost` is
/// right for them, a job rescued must never be gone). Every rescued job must be claimed again
/// once and its complete be `Done`, every cancel answer `true` exactly once, the slot
/// reclaimed only after all that, no error, no deadlock.
///
/// FOUND: PASSES.
#[test]
fn postgres_rescue_and_cancel_racing_the_reclaim_of_their_slot_lose_nothing() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    for round in 0..3 {
        let batch: Vec<NewJob> = (0..300).map(|_| NewJob::new("r", "x", vec![])).collect();
        let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        let slot = slot_of(&mut conn, ids[0]);
        let lapsing = jobs::claim(&mut conn, "r", 30, Duration::from_secs(1)).unwrap();
        let lapsing_ids: HashSet<i64> = lapsing.iter().map(|j| j.id).collect();
        let mut finished = 0;
        while finished < 240 {
            let got = jobs::claim(&mut conn, "r", (240 - finished).min(100), TTL).unwrap();
            assert!(!got.is_empty());
            finished += got.len();
            let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
            assert!(jobs::complete(&mut conn, &claims).unwrap().iter().all(|o| *o == Outcome::Done));
        }
        let waiting: Vec<i64> = ids
            .iter()
            .copied()
            .filter(|id| {
                count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id} AND state = 'waiting'")) == 1
            })
            .collect();
        assert_eq!(waiting.len(), 30, "round {round}");
        assert!(rotate(&mut conn).is_some(), "round {round}: no rotation");
        assert_ne!(current_slot(&mut conn), slot);

        let stop = Arc::new(AtomicBool::new(false));
        let churner = churn(db.url().to_string(), &["r"], true, stop.clone());
        let canceller = {
            let url = db.url().to_string();
            let waiting = waiting.clone();
            std::thread::spawn(move || {
                let mut c = AnyConnection::connect(&url).unwrap();
                waiting
                    .iter()
                    .map(|id| (*id, jobs::cancel(&mut c, *id).map_err(|e| e.to_string())))
                    .collect::<Vec<_>>()
            })
        };
        std::thread::sleep(Duration::from_millis(1_100));
        let rescuer = {
            let url = db.url().to_string();
            std::thread::spawn(move || {
                let mut c = AnyConnection::connect(&url).unwrap();
                let mut requeued = Vec::new();
                let mut other = Vec::new();
                let deadline = Instant::now() + Duration::from_secs(15);
                // Until no job of the queue runs (each lapsed claim either rescued or
                // completed by its old claim first).
                while Instant::now() < deadline
                    && count(&mut c, "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'r' AND state = 'running'") > 0
                {
                    match jobs::rescue(&mut c, 7) {
                        Ok(r) => {
                            requeued.extend(r.requeued);
                            other.extend(r.dead);
                            other.extend(r.cancelled);
                        }
                        Err(e) => other.push(-1_000_000 - e.to_string().len() as i64),
                    }
                }
                (requeued, other)
            })
        };
        // The old claims, lapsed: their completes race the rescue (Lost or Done, but a Done
        // means the job is completed, and then it is not rescued).
        let mut old_done = HashSet::new();
        for j in &lapsing {
            match jobs::complete(&mut conn, &[j.claim()]).unwrap()[0] {
                Outcome::Done => {
                    old_done.insert(j.id);
                }
                Outcome::Lost => {}
                other => panic!("round {round}: old claim of {}: {other:?}", j.id),
            }
        }
        let (requeued, other) = rescuer.join().unwrap();
        let cancels = canceller.join().unwrap();
        // Claim the rescued jobs again and complete them, with the churn still running.
        let mut again: Vec<i64> = Vec::new();
        let mut bad = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while again.len() < requeued.len() && Instant::now() < deadline {
            let got = jobs::claim(&mut conn, "r", 10, TTL).unwrap();
            let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
            for (j, o) in got.iter().zip(jobs::complete(&mut conn, &claims).unwrap()) {
                if o != Outcome::Done {
                    bad.push((j.id, o));
                }
                again.push(j.id);
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (reclaimed, rotations, errors) = churner.join().unwrap();
        eprintln!(
            "round {round}: slot {slot}, rescued {} (+{} other: {other:?}), old claims done {}, \
             claimed again {}, bad {bad:?}, cancels {:?}, reclaimed {reclaimed}, rotations \
             {rotations}, errors {errors:?}",
            requeued.len(),
            other.len(),
            old_done.len(),
            again.len(),
            cancels.iter().filter(|(_, r)| r.as_ref().ok() != Some(&true)).collect::<Vec<_>>()
        );
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        assert!(other.is_empty(), "round {round}: rescue gave {other:?}");
        let requeued_set: HashSet<i64> = requeued.iter().copied().collect();
        assert_eq!(requeued.len(), requeued_set.len(), "round {round}: rescued twice");
        let expected: HashSet<i64> = lapsing_ids.difference(&old_done).copied().collect();
        assert_eq!(requeued_set, expected, "round {round}: rescued set");
        let mut again_sorted = again.clone();
        again_sorted.sort_unstable();
        let mut requeued_sorted = requeued.clone();
        requeued_sorted.sort_unstable();
        assert_eq!(again_sorted, requeued_sorted, "round {round}: every rescued job claimed again once");
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert!(
            cancels.iter().all(|(_, r)| r.as_ref().ok() == Some(&true)),
            "round {round}: {cancels:?}"
        );
        // The slot goes now (all finished), with nothing beside it.
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["r"])).unwrap().slots > 0 {}
        assert_eq!(pages(&mut conn, slot), 0, "round {round}: slot {slot} left");
    }
    assert_eq!(deadlocks(&mut conn), 0);
}

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
        let running = jobs::enqueue(&mut conn, &NewJob::new("p", "running", vec![])).unwrap().id;
        let run = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(run.id, running);
        let v: i32 = jobs::run_step(&mut conn, run.claim(), "s", |_| Ok::<_, String>(41)).unwrap();
        assert_eq!(v, 41);
        let retried = jobs::enqueue(&mut conn, &NewJob::new("p", "retried", vec![]).max_attempts(3))
            .unwrap()
            .id;
        let r = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(r.id, retried);
        let _: i32 = jobs::run_step(&mut conn, r.claim(), "s", |_| Ok::<_, String>(7)).unwrap();
        assert_eq!(
            jobs::fail(&mut conn, r.claim(), "boom", Retry::After(Duration::from_millis(1500))).unwrap(),
            Outcome::Done
        );
        let snoozed = jobs::enqueue(&mut conn, &NewJob::new("p", "snoozed", vec![])).unwrap().id;
        let s = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(s.id, snoozed);
        assert_eq!(jobs::snooze(&mut conn, s.claim(), Duration::from_millis(1500)).unwrap(), Outcome::Done);
        let with_result = jobs::enqueue(&mut conn, &NewJob::new("p", "result", vec![])).unwrap().id;
        let w = jobs::claim(&mut conn, "p", 1, TTL).unwrap().remove(0);
        assert_eq!(w.id, with_result);
        jobs::complete_with_result(&mut conn, w.claim(), &JobResult::json(&round).unwrap()).unwrap();
        let batch: Vec<NewJob> = (0..200).map(|_| NewJob::new("p", "filler", vec![])).collect();
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
            let present = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id}"));
            seen.push((id, present));
        }
        let parked_rows = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_parked WHERE job_id = {}", parked.id));
        let step_rows = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_steps WHERE job_id IN ({running}, {retried})"));
        let result_rows = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_job_results WHERE job_id = {with_result}"));
        eprintln!("round {round}: slot {slot}: present {seen:?}, parked rows {parked_rows}, steps {step_rows}, results {result_rows}");
        assert!(seen.iter().all(|(_, n)| *n == 1), "round {round}: lost {seen:?}");
        assert_eq!((parked_rows, step_rows, result_rows), (1, 2, 1), "round {round}");

        // Use each while the churn goes on.
        assert_eq!(
            jobs::resume_parked(&mut conn, &parked.token, None).unwrap(),
            jobs::ParkedOutcome::Applied
        );
        let step_again: i32 =
            jobs::run_step(&mut conn, run.claim(), "s", |_| Ok::<_, String>(-1)).unwrap();
        assert_eq!(step_again, 41, "round {round}: the running job's step");
        assert_eq!(jobs::complete(&mut conn, &[run.claim()]).unwrap(), vec![Outcome::Done]);
        let inputs = jobs::dependency_results(&mut conn, dependent).unwrap();
        assert_eq!(inputs.len(), 1, "round {round}");
        assert_eq!(
            inputs[0].result.as_ref().map(|r| r.decode::<i32>().unwrap()),
            Some(round),
            "round {round}: the dependency's result"
        );
        let mut left: HashSet<i64> = [parked.id, retried, snoozed, dependent].into();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut bad = Vec::new();
        while !left.is_empty() && Instant::now() < deadline {
            for j in jobs::claim(&mut conn, "p", 10, TTL).unwrap() {
                if j.id == retried {
                    let v: i32 = jobs::run_step(&mut conn, j.claim(), "s", |_| Ok::<_, String>(-1)).unwrap();
                    if v != 7 {
                        bad.push(format!("retried job's step read {v}"));
                    }
                }
                if j.id == dependent {
                    let inputs = jobs::dependency_results(&mut conn, dependent).unwrap();
                    if inputs.len() != 1 || inputs[0].state != JobState::Completed || inputs[0].result.is_none() {
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
        eprintln!("round {round}: left {left:?}, bad {bad:?}, reclaimed {reclaimed}, rotations {rotations}, errors {errors:?}");
        assert!(left.is_empty(), "round {round}: never claimed again: {left:?}");
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        // Now all may go: the slot, and nothing beside its jobs stays.
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["p"])).unwrap().slots > 0 {}
        assert_eq!(pages(&mut conn, slot), 0, "round {round}: slot {slot} left");
        let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        for t in ["tenure_parked", "tenure_steps", "tenure_job_results", "tenure_job_errors"] {
            assert_eq!(
                count(&mut conn, &format!("SELECT COUNT(*) AS n FROM {t} WHERE job_id IN ({list})")),
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
        let batch: Vec<NewJob> = (0..100).map(|_| NewJob::new("w", "filler", vec![])).collect();
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
        assert_eq!(jobs::get(&mut conn, late).unwrap().unwrap().workflow_id, Some(made.id));

        let stop = Arc::new(AtomicBool::new(false));
        let churner = churn(db.url().to_string(), &["w"], true, stop.clone());
        let callback = made.on_success.unwrap();
        let mut done = Vec::new();
        let mut bad = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while done.len() < 4 && Instant::now() < deadline {
            for j in jobs::claim_kinds(&mut conn, "w", &["a", "b", "done", "late"], 1, TTL).unwrap() {
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
        eprintln!("round {round}: done {done:?}, bad {bad:?}, reclaimed {reclaimed}, rotations {rotations}, errors {errors:?}");
        assert_eq!(done.len(), 4, "round {round}: {done:?}");
        let unique: HashSet<_> = done.iter().collect();
        assert_eq!(unique.len(), 4, "round {round}: a job ran twice: {done:?}");
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        // Every slot of it goes; then the workflow's row and its edges go too.
        for _ in 0..6 {
            while jobs::reclaim_job_slots(&mut conn, &delete_all(&["w"])).unwrap().slots > 0 {}
            rotate(&mut conn);
        }
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["w"])).unwrap().slots > 0 {}
        let jobs_left = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE workflow_id = {}", made.id));
        let wf_rows = count(&mut conn, &format!("SELECT COUNT(*) AS n FROM tenure_workflows WHERE id = {}", made.id));
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
        eprintln!("round {round}: jobs left {jobs_left}, workflow rows {wf_rows}, orphan edges {orphan_edges}, stripes {orphan_stripes}, results {orphan_results}");
        assert_eq!(
            (jobs_left > 0, wf_rows),
            (jobs_left > 0, i64::from(jobs_left > 0)),
            "round {round}: a workflow row without jobs, or jobs without their workflow"
        );
        assert_eq!((orphan_edges, orphan_stripes, orphan_results), (0, 0, 0), "round {round}");
    }
    assert_eq!(deadlocks(&mut conn), 0);
}

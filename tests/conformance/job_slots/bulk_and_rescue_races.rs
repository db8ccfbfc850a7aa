//! Bulks by COPY, rescues and cancels racing rotations and the reclaim of their jobs' slot
//! (PostgreSQL's job slots): a bulk whose slot was read before a rotation or a reclaim lands
//! in a slot that then holds it; a lapsed claim rescued, a waiting job cancelled, a rescue
//! that cancels, each while its slot is being reclaimed: every job claimed once, every
//! finish of a live claim `Done`, no deadlock. (A helper's attacks; all passed when written.)

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenure::jobs::{self, NewJob, Outcome};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

use super::{churn, current_slot, deadlocks, delete_all, pages, rotate, slot_of};

const TTL: Duration = Duration::from_secs(60);

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
    let twice: Vec<_> = times
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| *id)
        .collect();
    let set: HashSet<i64> = claimed.iter().copied().collect();
    let never: Vec<i64> = enqueued
        .iter()
        .copied()
        .filter(|id| !set.contains(id))
        .collect();
    let never_present = never
        .iter()
        .filter(|id| {
            count(
                &mut conn,
                &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id}"),
            ) > 0
        })
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
    assert!(
        rotations > 3 && reclaimed > 3,
        "too little churn to prove anything"
    );
    assert!(errors.is_empty(), "{errors:?}");
    assert!(twice.is_empty(), "claimed twice: {twice:?}");
    assert!(
        never.is_empty(),
        "{} jobs never claimed: {:?}",
        never.len(),
        &never[..never.len().min(20)]
    );
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
            assert!(
                jobs::complete(&mut conn, &claims)
                    .unwrap()
                    .iter()
                    .all(|o| *o == Outcome::Done)
            );
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
                    && count(
                        &mut c,
                        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'r' AND state = 'running'",
                    ) > 0
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
            cancels
                .iter()
                .filter(|(_, r)| r.as_ref().ok() != Some(&true))
                .collect::<Vec<_>>()
        );
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        assert!(other.is_empty(), "round {round}: rescue gave {other:?}");
        let requeued_set: HashSet<i64> = requeued.iter().copied().collect();
        assert_eq!(
            requeued.len(),
            requeued_set.len(),
            "round {round}: rescued twice"
        );
        let expected: HashSet<i64> = lapsing_ids.difference(&old_done).copied().collect();
        assert_eq!(requeued_set, expected, "round {round}: rescued set");
        let mut again_sorted = again.clone();
        again_sorted.sort_unstable();
        let mut requeued_sorted = requeued.clone();
        requeued_sorted.sort_unstable();
        assert_eq!(
            again_sorted, requeued_sorted,
            "round {round}: every rescued job claimed again once"
        );
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert!(
            cancels.iter().all(|(_, r)| r.as_ref().ok() == Some(&true)),
            "round {round}: {cancels:?}"
        );
        // The slot goes now (all finished), with nothing beside it.
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["r"]))
            .unwrap()
            .slots
            > 0
        {}
        assert_eq!(pages(&mut conn, slot), 0, "round {round}: slot {slot} left");
    }
    assert_eq!(deadlocks(&mut conn), 0);
}

/// Attacks: the rescue that *finishes* a job (a cancel asked while it ran, then its claim
/// lapsed: rescued as `cancelled`), making its slot reclaimable at that instant, while a
/// reclaimer and rotator spin (DeleteAll) and the lapsed claims' own completes race the
/// rescue. Each round: 200 jobs in one slot, 20 claimed with a 1-second ttl and asked to
/// cancel, the rest completed, a rotation; after the lapse a rescuer, and the old claims'
/// completes. Each of the 20 must end exactly one way: the old claim's complete answered
/// `Cancelled` (it came first) or the rescue listed it cancelled (the complete then `Lost`);
/// no error from any call, the slot reclaimed afterwards, no deadlock.
///
/// FOUND: PASSES.
#[test]
fn postgres_a_rescue_that_cancels_races_the_reclaim_and_the_old_claims() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    for round in 0..3 {
        let batch: Vec<NewJob> = (0..200).map(|_| NewJob::new("c", "x", vec![])).collect();
        let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        let slot = slot_of(&mut conn, ids[0]);
        let lapsing = jobs::claim(&mut conn, "c", 20, Duration::from_secs(1)).unwrap();
        for j in &lapsing {
            assert!(
                jobs::cancel(&mut conn, j.id).unwrap(),
                "round {round}: cancel of running {}",
                j.id
            );
        }
        loop {
            let got = jobs::claim(&mut conn, "c", 100, TTL).unwrap();
            if got.is_empty() {
                break;
            }
            let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
            jobs::complete(&mut conn, &claims).unwrap();
        }
        assert!(rotate(&mut conn).is_some(), "round {round}: no rotation");
        let stop = Arc::new(AtomicBool::new(false));
        let churner = churn(db.url().to_string(), &["c"], true, stop.clone());
        std::thread::sleep(Duration::from_millis(1_050));
        let rescuer = {
            let url = db.url().to_string();
            std::thread::spawn(move || {
                let mut c = AnyConnection::connect(&url).unwrap();
                let mut cancelled = Vec::new();
                let mut other = Vec::new();
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline
                    && count(
                        &mut c,
                        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'c' AND state = 'running'",
                    ) > 0
                {
                    match jobs::rescue(&mut c, 3) {
                        Ok(r) => {
                            cancelled.extend(r.cancelled);
                            other
                                .extend(r.requeued.iter().chain(&r.dead).map(|id| format!("{id}")));
                        }
                        Err(e) => other.push(e.to_string()),
                    }
                }
                (cancelled, other)
            })
        };
        let mut by_complete = Vec::new();
        let mut errors_seen = Vec::new();
        let mut old_complete = |conn: &mut AnyConnection, j: &jobs::ClaimedJob| match jobs::complete(
            conn,
            &[j.claim()],
        ) {
            Ok(o) if o == vec![Outcome::Cancelled] => by_complete.push(j.id),
            Ok(o) if o == vec![Outcome::Lost] => {}
            other => errors_seen.push(format!("{}: {other:?}", j.id)),
        };
        // Half the old claims race the rescue; the other half come after it, while the
        // churn reclaims the slot under them.
        for j in lapsing.iter().rev().step_by(2) {
            old_complete(&mut conn, j);
        }
        let (cancelled, other) = rescuer.join().unwrap();
        for j in lapsing.iter().rev().skip(1).step_by(2) {
            old_complete(&mut conn, j);
            std::thread::sleep(Duration::from_millis(30));
        }
        stop.store(true, Ordering::Relaxed);
        let (reclaimed, rotations, errors) = churner.join().unwrap();
        eprintln!(
            "round {round}: slot {slot}: rescued cancelled {}, cancelled by complete {}, other {other:?}, \
             errors {errors_seen:?} {errors:?}, reclaimed {reclaimed}, rotations {rotations}",
            cancelled.len(),
            by_complete.len()
        );
        assert!(
            errors.is_empty() && errors_seen.is_empty() && other.is_empty(),
            "round {round}"
        );
        let a: HashSet<i64> = cancelled.iter().copied().collect();
        let b: HashSet<i64> = by_complete.iter().copied().collect();
        assert!(
            a.is_disjoint(&b),
            "round {round}: both rescued and cancelled by its claim"
        );
        let all: HashSet<i64> = lapsing.iter().map(|j| j.id).collect();
        assert_eq!(
            a.union(&b).copied().collect::<HashSet<_>>(),
            all,
            "round {round}"
        );
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["c"]))
            .unwrap()
            .slots
            > 0
        {}
        assert_eq!(pages(&mut conn, slot), 0, "round {round}: slot {slot} left");
    }
    assert_eq!(deadlocks(&mut conn), 0);
}

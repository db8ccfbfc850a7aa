//! Claims racing cancels, folds, aging, rotations and limits, on every backend: one claim at a
//! time, nothing lost (a job the mark passes over keeps its entry), limits and rate starts
//! exact, and (PostgreSQL) no deadlock between a claim and a writer of a waiting job.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use diesel::{Connection, QueryableByName, RunQueryDsl};
use tenure::jobs::{self, JobClaim, NewJob, OnDuplicate, Outcome};
use tenure::{AnyConnection, Backend};

use super::{deadlocks, end_round, nothing_live};
use crate::common::{TestDb, conformance, count};

conformance!(claims_race_cancels_folds_aging_rotations_and_limits);

const TTL: Duration = Duration::from_secs(60);

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

/// One job of round `round`, number `i`: every job has a dedup key; a quarter are capped on
/// key `k` (at [`CAP`]), a quarter rated on `r` (never full: the starts are counted), a
/// quarter fair across three tenants, some urgent.
fn job(round: usize, i: usize, payload: &str) -> NewJob {
    let mut job = NewJob::new("race", "work", payload.as_bytes().to_vec())
        .dedup_key(format!("d{round}-{i}"))
        .priority((i % 3) as i32);
    job = match i % 4 {
        0 => job.limit("k", CAP as u32),
        1 => job.rate_limit("r", 10_000, Duration::from_secs(3600)),
        2 => job.fair_key(format!("t{}", i % 3)),
        _ => job,
    };
    job
}

const CAP: i64 = 2;

/// Many rounds: each enqueues 40 jobs (dedup keys, a capped key, a rate, fair tenants),
/// then three claimers (batches of 1, 3 and 7, each job held a moment before it completes)
/// race a canceller, a folder (`Replace` and `KeepEarlierDue`: the job's entry moves; `Keep`
/// inside a transaction held open a moment: the job is locked, its entry untouched), the
/// ager, ring rotations and a sampler of the capped key's running jobs. The round ends when
/// nothing waits or runs (a waiting job whose entry was lost would never be claimed: the
/// round would not end). Then: no job claimed twice nor after its cancel, every claimed job
/// completes (or was asked to cancel), the cap was never passed, the rate's starts are the
/// rated jobs claimed, the ring lists exactly the waiting jobs, and PostgreSQL counted no
/// deadlock.
fn claims_race_cancels_folds_aging_rotations_and_limits(backend: Backend) {
    const ROUNDS: usize = 12;
    const JOBS: usize = 40;
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    let claimed: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let outcomes: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let max_running = Arc::new(AtomicI64::new(0));
    let mut cancelled_waiting = 0usize;
    let mut fold_retries = 0usize;
    let mut sessions: Vec<AnyConnection> = Vec::new();
    let started = Clock::now();
    for round in 0..ROUNDS {
        let batch: Vec<NewJob> = (0..JOBS).map(|i| job(round, i, "first")).collect();
        let round_ids: Vec<i64> = jobs::enqueue_many(&mut setup, &batch)
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        let disrupting = Arc::new(AtomicBool::new(true));
        let give_up = Clock::now() + Duration::from_secs(60);
        let claimers: Vec<_> = [1usize, 3, 7]
            .into_iter()
            .map(|size| {
                let mut conn = db.connect();
                let (claimed, outcomes, disrupting) =
                    (claimed.clone(), outcomes.clone(), disrupting.clone());
                std::thread::spawn(move || {
                    loop {
                        assert!(
                            Clock::now() < give_up,
                            "round {round}: jobs still wait or run after 60 s (lost?)"
                        );
                        let got = jobs::claim(&mut conn, "race", size, TTL).expect("claim");
                        if got.is_empty() {
                            if !disrupting.load(Ordering::SeqCst) && nothing_live(&mut conn, "race")
                            {
                                return conn;
                            }
                            std::thread::sleep(Duration::from_millis(1));
                            continue;
                        }
                        {
                            let mut map = claimed.lock().unwrap();
                            for j in &got {
                                *map.entry(j.id).or_default() += 1;
                                assert_eq!(j.attempt, 1, "job {} claimed again", j.id);
                            }
                        }
                        std::thread::sleep(Duration::from_millis(2));
                        let claims: Vec<JobClaim> = got.iter().map(|j| j.claim()).collect();
                        let done = jobs::complete(&mut conn, &claims).expect("complete");
                        let mut map = outcomes.lock().unwrap();
                        for outcome in done {
                            *map.entry(format!("{outcome:?}")).or_default() += 1;
                        }
                    }
                })
            })
            .collect();
        let spawn = |f: Box<dyn FnOnce(&mut AnyConnection) -> usize + Send>| {
            let mut conn = db.connect();
            std::thread::spawn(move || {
                let n = f(&mut conn);
                (conn, n)
            })
        };
        let to_cancel: Vec<i64> = round_ids.iter().copied().step_by(5).collect();
        let canceller = spawn(Box::new(move |c| {
            let mut n = 0;
            for id in to_cancel {
                let before = count(
                    c,
                    &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id}"),
                );
                assert_eq!(before, 1);
                if jobs::cancel(c, id).expect("cancel") {
                    n += 1;
                }
            }
            n
        }));
        let folder = spawn(Box::new(move |c| {
            for i in (0..JOBS).step_by(3) {
                let mode = if i % 2 == 0 {
                    OnDuplicate::Replace
                } else {
                    OnDuplicate::KeepEarlierDue
                };
                jobs::enqueue(c, &job(round, i, "replaced").on_duplicate(mode)).expect("fold");
            }
            0
        }));
        let open_folder = spawn(Box::new(move |c| {
            // A caller's transaction is the caller's to repeat (MariaDB may pick it as a
            // deadlock's victim): the retries are counted.
            let mut retried = 0;
            for i in (1..JOBS).step_by(4) {
                loop {
                    match c.transaction::<_, tenure::Error, _>(|c| {
                        jobs::enqueue(c, &job(round, i, "kept").on_duplicate(OnDuplicate::Keep))?;
                        std::thread::sleep(Duration::from_millis(3));
                        Ok(())
                    }) {
                        Ok(()) => break,
                        Err(e) if e.is_retryable() => retried += 1,
                        Err(e) => panic!("fold in a transaction: {e:?}"),
                    }
                }
            }
            retried
        }));
        let ager = spawn(Box::new(|c| {
            let mut aged = 0;
            for _ in 0..20 {
                aged += jobs::age_priorities(c, "race", Duration::from_millis(1), 5).expect("age");
                std::thread::sleep(Duration::from_millis(1));
            }
            aged
        }));
        let rotator = spawn(Box::new(|c| {
            let mut moved = 0;
            for _ in 0..20 {
                moved += jobs::rotate_ready(c, Duration::ZERO)
                    .expect("rotate")
                    .unwrap_or(0) as usize;
                std::thread::sleep(Duration::from_millis(1));
            }
            moved
        }));
        let sampling = disrupting.clone();
        let max = max_running.clone();
        let sampler = spawn(Box::new(move |c| {
            let mut samples = 0;
            while sampling.load(Ordering::SeqCst) {
                let running = count(
                    c,
                    "SELECT COUNT(*) AS n FROM tenure_jobs WHERE limit_key = 'k' \
                     AND state = 'running'",
                );
                max.fetch_max(running, Ordering::SeqCst);
                samples += 1;
            }
            samples
        }));
        for (name, t) in [
            ("canceller", canceller),
            ("folder", folder),
            ("open folder", open_folder),
            ("ager", ager),
            ("rotator", rotator),
        ] {
            let (conn, n) = t.join().unwrap_or_else(|_| panic!("the {name} panicked"));
            match name {
                "canceller" => cancelled_waiting += n,
                "open folder" => fold_retries += n,
                _ => {}
            }
            sessions.push(conn);
        }
        disrupting.store(false, Ordering::SeqCst);
        sessions.push(sampler.join().unwrap().0);
        for t in claimers {
            sessions.push(t.join().expect("a claimer panicked"));
        }
        end_round(
            backend,
            &mut setup,
            std::mem::take(&mut sessions),
            "race",
            round,
        );
        if backend != Backend::Sqlite {
            assert_eq!(
                count(&mut setup, "SELECT COUNT(*) AS n FROM tenure_ready"),
                0,
                "round {round}: the ring lists no job that does not wait"
            );
        }
    }
    let claimed = claimed.lock().unwrap();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "jobs claimed more than once: {twice:?}");
    let cancelled_unclaimed: HashSet<i64> = diesel::sql_query(
        "SELECT id FROM tenure_jobs WHERE state = 'cancelled' AND cancel_requested_at IS NULL",
    )
    .load::<Id>(&mut setup)
    .unwrap()
    .into_iter()
    .map(|r| r.id)
    .collect();
    let both: Vec<_> = cancelled_unclaimed
        .iter()
        .filter(|id| claimed.contains_key(id))
        .collect();
    assert!(
        both.is_empty(),
        "jobs cancelled while waiting and claimed: {both:?}"
    );
    assert_eq!(
        count(
            &mut setup,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE claimed_at IS NOT NULL"
        ),
        claimed.len() as i64,
        "every job marked running was handed to its claimer"
    );
    let outcomes = outcomes.lock().unwrap();
    assert!(
        outcomes
            .keys()
            .all(|outcome| outcome == &format!("{:?}", Outcome::Done)
                || outcome == &format!("{:?}", Outcome::Cancelled)),
        "completions: {outcomes:?}"
    );
    let max_running = max_running.load(Ordering::SeqCst);
    assert!(max_running <= CAP, "{max_running} capped jobs ran at once");
    let rated_claimed = count(
        &mut setup,
        "SELECT COUNT(*) AS n FROM tenure_jobs j JOIN tenure_job_limits l ON l.job_id = j.id \
         WHERE l.limit_key = 'r' AND j.claimed_at IS NOT NULL",
    );
    assert_eq!(
        count(
            &mut setup,
            "SELECT COUNT(*) AS n FROM tenure_limit_starts WHERE limit_key = 'r'"
        ),
        rated_claimed,
        "the rate's starts are the rated jobs claimed"
    );
    let deadlocked = if backend == Backend::Postgres {
        deadlocks(&db, &mut sessions)
    } else {
        0
    };
    println!(
        "{backend}: {ROUNDS} rounds x {JOBS} jobs: {} claimed once each, {cancelled_waiting} \
         cancels, {fold_retries} caller folds repeated, completions {outcomes:?}, capped running at most {max_running}, \
         {rated_claimed} rated starts, {deadlocked} deadlocks, {:?}",
        claimed.len(),
        started.elapsed()
    );
    assert_eq!(deadlocked, 0, "PostgreSQL detected deadlocks");
}

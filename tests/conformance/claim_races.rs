//! Claims under concurrency, on every backend: enqueues racing claims lose nothing, eight
//! claimers never share a job, a claim that lapsed is fenced off after its rescue, and
//! heartbeats race rescues without errors.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use tenure::jobs::{self, JobClaim, JobState, NewJob, Outcome, Retry};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count};

conformance!(
    enqueue_while_claiming_completes_every_job_once,
    eight_claimers_never_share_a_job,
    a_lapsed_worker_is_refused_after_a_rescue,
    heartbeats_and_rescues_race_without_errors,
);

const TTL: Duration = Duration::from_secs(60);

fn claims(jobs: &[jobs::ClaimedJob]) -> Vec<JobClaim> {
    jobs.iter().map(|j| j.claim()).collect()
}

fn state_of(conn: &mut AnyConnection, id: i64) -> JobState {
    jobs::get(conn, id).unwrap().expect("the job exists").state
}

/// The reference report's test: 6 threads enqueue 400 jobs each (every other one delayed a
/// few ms) while 4 threads claim and complete. No error of any kind; every job has exactly one
/// successful completion.
fn enqueue_while_claiming_completes_every_job_once(backend: Backend) {
    const ENQUEUERS: usize = 6;
    const PER_ENQUEUER: usize = 400;
    const CLAIMERS: usize = 4;
    const TOTAL: usize = ENQUEUERS * PER_ENQUEUER;
    let db = TestDb::migrated(backend);
    let done = Arc::new(AtomicUsize::new(0));
    let completions: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let started = Clock::now();
    let enqueuers: Vec<_> = (0..ENQUEUERS)
        .map(|e| {
            let mut conn = db.connect();
            std::thread::spawn(move || {
                (0..PER_ENQUEUER)
                    .map(|i| {
                        let mut job = NewJob::new("ref", "work", format!("{e}/{i}").into_bytes());
                        if i % 2 == 1 {
                            job = job.delay(Duration::from_millis(5));
                        }
                        jobs::enqueue(&mut conn, &job)
                            .expect("enqueue must not fail")
                            .id
                    })
                    .collect::<Vec<i64>>()
            })
        })
        .collect();
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let (done, completions) = (done.clone(), completions.clone());
            std::thread::spawn(move || {
                let give_up = Clock::now() + Duration::from_secs(45);
                while done.load(Ordering::SeqCst) < TOTAL && Clock::now() < give_up {
                    let batch =
                        jobs::claim(&mut conn, "ref", 10, TTL).expect("claim must not fail");
                    if batch.is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    let outcomes =
                        jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
                    let mut map = completions.lock().unwrap();
                    for (job, outcome) in batch.iter().zip(outcomes) {
                        if outcome == Outcome::Done {
                            *map.entry(job.id).or_default() += 1;
                            done.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    let mut enqueued: Vec<i64> = Vec::new();
    for t in enqueuers {
        enqueued.extend(t.join().expect("an enqueuer panicked"));
    }
    for t in claimers {
        t.join().expect("a claimer panicked");
    }
    let map = completions.lock().unwrap();
    assert_eq!(enqueued.len(), TOTAL);
    assert_eq!(
        enqueued.iter().collect::<HashSet<_>>().len(),
        TOTAL,
        "ids are unique"
    );
    for id in &enqueued {
        assert_eq!(map.get(id), Some(&1), "job {id} completions");
    }
    assert_eq!(map.len(), TOTAL);
    let mut conn = db.connect();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'"
        ),
        TOTAL as i64
    );
    println!(
        "{backend} reference test: {ENQUEUERS} enqueuers x {PER_ENQUEUER} jobs, {CLAIMERS} claimers: \
         {TOTAL} jobs, each completed exactly once, 0 errors, {:?}",
        started.elapsed()
    );
}

fn eight_claimers_never_share_a_job(backend: Backend) {
    const JOBS: usize = 2000;
    const CLAIMERS: usize = 8;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|i| NewJob::new("share", "k", i.to_string().into_bytes()))
        .collect();
    let ids = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect::<Vec<i64>>();
    assert_eq!(ids.len(), JOBS);
    let claimed_total = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let claimed_total = claimed_total.clone();
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                let give_up = Clock::now() + Duration::from_secs(45);
                while claimed_total.load(Ordering::SeqCst) < JOBS && Clock::now() < give_up {
                    let batch = jobs::claim(&mut conn, "share", 25, TTL).expect("claim");
                    claimed_total.fetch_add(batch.len(), Ordering::SeqCst);
                    mine.extend(batch.into_iter().map(|j| (j.id, j.payload)));
                }
                mine
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in threads {
        all.extend(t.join().unwrap());
    }
    let unique: HashSet<i64> = all.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        all.len(),
        JOBS,
        "claims handed out {} jobs for {JOBS}",
        all.len()
    );
    assert_eq!(unique.len(), JOBS, "a job was handed out twice");
    // enqueue_many's ids map to the right rows.
    for (id, payload) in &all {
        let i = ids
            .iter()
            .position(|x| x == id)
            .expect("a claimed id was enqueued");
        assert_eq!(payload, &i.to_string().into_bytes());
    }
    println!(
        "{backend} {CLAIMERS} claimers over {JOBS} jobs in batches of 25: {} claimed, {} distinct",
        all.len(),
        unique.len()
    );
}

fn a_lapsed_worker_is_refused_after_a_rescue(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut a = db.connect();
    let mut b = db.connect();
    let id = jobs::enqueue(&mut a, &NewJob::new("f", "k", vec![1]))
        .unwrap()
        .id;
    // A long ttl, then the lapse forced: "not lapsed yet" cannot depend on how fast the
    // rescue follows the claim (a 200 ms ttl had lapsed already in a busy CI run).
    let first = jobs::claim(&mut a, "f", 1, TTL).unwrap().remove(0);
    assert_eq!((first.id, first.attempt), (id, 1));
    assert!(
        jobs::rescue(&mut b, 100).unwrap().requeued.is_empty(),
        "not lapsed yet"
    );
    diesel::connection::SimpleConnection::batch_execute(
        &mut b,
        &format!("UPDATE tenure_jobs SET claim_expires_at = created_at WHERE id = {id}"),
    )
    .unwrap();
    assert_eq!(jobs::rescue(&mut b, 100).unwrap().requeued, vec![id]);
    let second = jobs::claim(&mut b, "f", 1, TTL).unwrap().remove(0);
    // A lapsed claim uses no attempt (the worker may have died before the run began).
    assert_eq!((second.id, second.attempt), (id, 1));
    assert_ne!(second.token, first.token);

    let stale = first.claim();
    assert_eq!(
        jobs::complete(&mut a, &[stale]).unwrap(),
        vec![Outcome::Lost]
    );
    assert_eq!(
        jobs::fail(&mut a, stale, "late", Retry::Never).unwrap(),
        Outcome::Lost
    );
    assert_eq!(
        jobs::renew(&mut a, &[stale], TTL).unwrap(),
        vec![Outcome::Lost]
    );
    assert_eq!(
        jobs::give_back(&mut a, &[stale]).unwrap(),
        vec![Outcome::Lost]
    );
    let job = jobs::get(&mut a, id).unwrap().unwrap();
    assert_eq!(
        (job.state, job.attempt, job.lapses),
        (JobState::Running, 1, 1)
    );

    assert_eq!(
        jobs::complete(&mut b, &[second.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    // The same call again (a lost reply, retried) is "already done", not "lost".
    assert_eq!(
        jobs::complete(&mut b, &[second.claim()]).unwrap(),
        vec![Outcome::AlreadyDone]
    );
    assert_eq!(
        jobs::complete(&mut a, &[stale]).unwrap(),
        vec![Outcome::Lost]
    );
    assert_eq!(state_of(&mut a, id), JobState::Completed);
}

/// Workers heartbeat their claims, sometimes stop (stalling), while rescuers run: no error
/// (no deadlock) and no job lost.
fn heartbeats_and_rescues_race_without_errors(backend: Backend) {
    const JOBS: usize = 200;
    // Each worker's cycle (claim, heartbeat, sometimes a stall) is 20-50 ms and the rescuers
    // loop every few ms: 5 s is hundreds of cycles each.
    const RUN: Duration = Duration::from_secs(5);
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("hb", "k", vec![]).max_attempts(1000))
        .collect();
    let ids = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect::<Vec<i64>>();
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let short = Duration::from_millis(150);
    let mut threads = Vec::new();
    for w in 0..4 {
        let mut conn = db.connect();
        let (stop, counters) = (stop.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            let mut held: Vec<JobClaim> = Vec::new();
            let mut tick = 0u64;
            while !stop.load(Ordering::SeqCst) {
                tick += 1;
                if held.len() < 20 {
                    let got = jobs::claim(&mut conn, "hb", 10, short).expect("claim");
                    held.extend(got.iter().map(|j| j.claim()));
                }
                if held.is_empty() {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                let outcomes = jobs::renew(&mut conn, &held, short).expect("heartbeat");
                counters[0].fetch_add(outcomes.len(), Ordering::Relaxed);
                held = held
                    .into_iter()
                    .zip(outcomes)
                    .filter(|(_, o)| *o == Outcome::Done)
                    .map(|(c, _)| c)
                    .collect();
                // Every few ticks one worker drops its claims on the floor: they stall.
                if (tick + w) % 7 == 0 {
                    held.clear();
                }
                std::thread::sleep(Duration::from_millis(20 + 10 * w));
            }
            if !held.is_empty() {
                jobs::give_back(&mut conn, &held).expect("give back");
            }
        }));
    }
    for _ in 0..2 {
        let mut conn = db.connect();
        let (stop, counters) = (stop.clone(), counters.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let rescued = jobs::rescue(&mut conn, 50).expect("rescue");
                counters[1].fetch_add(rescued.requeued.len(), Ordering::Relaxed);
                counters[2].fetch_add(rescued.dead.len(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(3));
            }
        }));
    }
    std::thread::sleep(RUN);
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().expect("a worker or rescuer failed");
    }
    // Drain: after the last claims lapse, every job is rescued or waiting, and completes once.
    std::thread::sleep(short * 2);
    let last = jobs::rescue(&mut conn, 1000).unwrap();
    // Jobs dropped MAX_LAPSES times are dead (lapses, not lost): they run again from here.
    let dead = jobs::retry_dead_of_kind(&mut conn, "hb", "k").unwrap();
    assert_eq!(dead, counters[2].load(Ordering::Relaxed) + last.dead.len());
    let mut completed = HashSet::new();
    loop {
        let batch = jobs::claim(&mut conn, "hb", 100, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        for (job, outcome) in batch
            .iter()
            .zip(jobs::complete(&mut conn, &claims(&batch)).unwrap())
        {
            assert_eq!(outcome, Outcome::Done);
            assert!(completed.insert(job.id));
        }
    }
    assert_eq!(
        completed,
        ids.into_iter().collect::<HashSet<_>>(),
        "every job is still there"
    );
    println!(
        "{backend} heartbeat/rescue race for {RUN:?}: {} renewals, {} rescued, {} dead, 0 errors, {JOBS} jobs all completed after",
        counters[0].load(Ordering::Relaxed),
        counters[1].load(Ordering::Relaxed),
        counters[2].load(Ordering::Relaxed)
    );
}

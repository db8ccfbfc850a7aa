//! Attacks on issue 37's promises on Galera, beyond galera.rs: MariaDB's ready ring rotated on
//! one node while the others enqueue, claim and cancel; concurrency limits (per key, per
//! queue) with claimers on several nodes; a dedup key enqueued on every node at once; a
//! workflow's dependencies completed on different nodes at the same instant.
//!
//! Found here and fixed (issue 37; SCALING.md, section 0.1): limits exceeded across nodes (a
//! limit's lock was a row lock, each node's own, and wrote nothing Galera certifies: claims
//! now write the limit's row), a claim's mark committed on its own after Galera rolled its
//! transaction back (the mark now holds only inside its transaction), and the ring's
//! rotation stalling every node (a Galera node declines to rotate). Run by
//! `scripts/test-clusters galera`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use tenure::AnyConnection;
use tenure::jobs::{self, NewJob, Outcome};

use super::galera::ClusterDb;

pub(super) const TTL: Duration = Duration::from_secs(120);

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// One job per call (a bulk enqueue is tested in galera.rs).
pub(super) fn enqueue_each(conn: &mut AnyConnection, batch: &[NewJob]) -> Vec<i64> {
    batch
        .iter()
        .map(|job| jobs::enqueue(conn, job).expect("enqueue").id)
        .collect()
}

pub(super) fn count(conn: &mut AnyConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<N>(conn)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .n
}

/// Waits until every node has `n` jobs in `tenure_jobs` (Galera applies other nodes' commits
/// asynchronously: a read right after a commit elsewhere may not see it yet).
pub(super) fn settle(db: &ClusterDb, n: i64) {
    for url in &db.urls {
        let mut conn = AnyConnection::connect(url).expect("a node");
        let deadline = Instant::now() + Duration::from_secs(20);
        while count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs") != n {
            assert!(Instant::now() < deadline, "{url} never had {n} jobs");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Claims on `conn` until the call returns without a retryable error.
pub(super) fn claim_retrying(
    conn: &mut AnyConnection,
    queue: &str,
    max: usize,
) -> Vec<jobs::ClaimedJob> {
    for _ in 0..500 {
        match jobs::claim(conn, queue, max, TTL) {
            Ok(got) => return got,
            Err(e) if e.is_retryable() => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => panic!("claim: {e}"),
        }
    }
    panic!("claim: refused 500 times in a row")
}

pub(super) fn complete_retrying(
    conn: &mut AnyConnection,
    claims: &[jobs::JobClaim],
) -> Vec<Outcome> {
    let mut last = String::new();
    for _ in 0..500 {
        match jobs::complete(conn, claims) {
            Ok(outcomes) => return outcomes,
            Err(e) if e.is_retryable() => {
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => panic!("complete: {e} ({e:?})"),
        }
    }
    panic!("complete: refused 500 times in a row, last: {last}")
}

/// Six claimers, two per node, each claiming one job at a time of 60 that share the limit
/// key "k" with a cap of 1 (`NewJob::limit`), holding it 30 ms before completing it. The
/// promise: at most one runs at once, across every worker and process. A key's lock is a
/// row lock (`SELECT ... FOR UPDATE` / a no-op upsert), each node's own on Galera, and the
/// running count is a plain read: two nodes may both see 0 running and both admit.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_key_limit_of_one_holds_with_claimers_on_three_nodes() {
    const JOBS: usize = 60;
    let db = ClusterDb::new();
    let mut conn = AnyConnection::connect(&db.urls[0]).expect("node 1");
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("lim", "k", vec![]).limit("k", 1))
        .collect();
    enqueue_each(&mut conn, &batch);
    settle(&db, JOBS as i64);
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let overlaps: Arc<Mutex<Vec<(usize, i64)>>> = Arc::default();
    let barrier = Arc::new(Barrier::new(6));
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let mut conn = AnyConnection::connect(&db.urls[i % 3]).expect("a node");
            let (running, most, done, overlaps, barrier) = (
                running.clone(),
                most.clone(),
                done.clone(),
                overlaps.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                barrier.wait();
                let until = Instant::now() + Duration::from_secs(60);
                while done.load(Ordering::SeqCst) < JOBS && Instant::now() < until {
                    let got = claim_retrying(&mut conn, "lim", 1);
                    let Some(job) = got.first() else {
                        std::thread::sleep(Duration::from_millis(3));
                        continue;
                    };
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    if now > 1 {
                        overlaps.lock().unwrap().push((i % 3 + 1, job.id));
                    }
                    std::thread::sleep(Duration::from_millis(30));
                    running.fetch_sub(1, Ordering::SeqCst);
                    let outcome = complete_retrying(&mut conn, &[job.claim()]);
                    assert_eq!(outcome, vec![Outcome::Done], "job {}", job.id);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a claimer panicked");
    }
    let most = most.load(Ordering::SeqCst);
    eprintln!(
        "Galera, key limit 1, claimers on 3 nodes: {} of {JOBS} done, at most {most} at once; \
         overlapping starts (node, job): {:?}",
        done.load(Ordering::SeqCst),
        overlaps.lock().unwrap()
    );
    assert!(
        most <= 1,
        "a key limited to 1 ran {most} jobs at once (claimers on different nodes): {:?}",
        overlaps.lock().unwrap()
    );
    assert_eq!(done.load(Ordering::SeqCst), JOBS);
}

/// The same with a queue's limit (`jobs::limit_queue(.., Some(1))`): the queue's lock is a
/// `SELECT ... FOR UPDATE` of its row in `tenure_queue_limits`, node-local on Galera.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_queue_limit_of_one_holds_with_claimers_on_three_nodes() {
    const JOBS: usize = 60;
    let db = ClusterDb::new();
    let mut conn = AnyConnection::connect(&db.urls[0]).expect("node 1");
    jobs::limit_queue(&mut conn, "qlim", Some(1)).unwrap();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("qlim", "k", vec![]))
        .collect();
    enqueue_each(&mut conn, &batch);
    settle(&db, JOBS as i64);
    for url in &db.urls {
        let mut conn = AnyConnection::connect(url).expect("a node");
        let deadline = Instant::now() + Duration::from_secs(20);
        while count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_queue_limits") != 1 {
            assert!(Instant::now() < deadline, "{url} never had the limit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(6));
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let mut conn = AnyConnection::connect(&db.urls[i % 3]).expect("a node");
            let (running, most, done, barrier) =
                (running.clone(), most.clone(), done.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let until = Instant::now() + Duration::from_secs(60);
                while done.load(Ordering::SeqCst) < JOBS && Instant::now() < until {
                    let got = claim_retrying(&mut conn, "qlim", 1);
                    let Some(job) = got.first() else {
                        std::thread::sleep(Duration::from_millis(3));
                        continue;
                    };
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(30));
                    running.fetch_sub(1, Ordering::SeqCst);
                    complete_retrying(&mut conn, &[job.claim()]);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a claimer panicked");
    }
    let most = most.load(Ordering::SeqCst);
    eprintln!("Galera, queue limit 1, claimers on 3 nodes: at most {most} at once");
    assert!(
        most <= 1,
        "a queue limited to 1 ran {most} jobs at once (claimers on different nodes)"
    );
}

/// Thirty rounds: the same dedup key enqueued on all three nodes at the same instant. The
/// promise: one live job per queue and key; every enqueue returns that job.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_dedup_key_enqueued_on_three_nodes_at_once_makes_one_job() {
    const ROUNDS: usize = 30;
    let db = ClusterDb::new();
    let barrier = Arc::new(Barrier::new(3));
    let returned: Arc<Mutex<Vec<(usize, i64)>>> = Arc::default();
    let retried = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..3)
        .map(|i| {
            let mut conn = AnyConnection::connect(&db.urls[i]).expect("a node");
            let (barrier, returned, retried) = (barrier.clone(), returned.clone(), retried.clone());
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    barrier.wait();
                    let job = NewJob::new("dd", "k", vec![]).dedup_key(format!("key-{round}"));
                    let id = loop {
                        match jobs::enqueue(&mut conn, &job) {
                            Ok(e) => break e.id,
                            Err(e) if e.is_retryable() => {
                                retried.fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(2));
                            }
                            Err(e) => panic!("round {round}: {e}"),
                        }
                    };
                    returned.lock().unwrap().push((round, id));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("an enqueuer panicked");
    }
    std::thread::sleep(Duration::from_secs(1));
    let mut conn = AnyConnection::connect(&db.urls[0]).expect("node 1");
    let returned = returned.lock().unwrap();
    let mut broken = Vec::new();
    for round in 0..ROUNDS {
        let ids: BTreeSet<i64> = returned
            .iter()
            .filter(|(r, _)| *r == round)
            .map(|(_, id)| *id)
            .collect();
        let rows = count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE dedup_key = 'key-{round}'"),
        );
        if ids.len() != 1 || rows != 1 {
            broken.push((round, ids, rows));
        }
    }
    eprintln!(
        "Galera, a dedup key on 3 nodes at once, {ROUNDS} rounds: {} retried; broken: {broken:?}",
        retried.load(Ordering::SeqCst)
    );
    assert!(
        broken.is_empty(),
        "(round, ids returned, jobs with the key): {broken:?}"
    );
}

/// MariaDB's ready ring rotated on node 1 (`rotate_ready(.., ZERO)`, in a loop) while node 2
/// enqueues (some in a REPEATABLE READ transaction whose read view began before the last
/// rotations: its trigger reads an old generation and writes an older slot) and cancels,
/// and node 3 claims. The rotation's `LOCK TABLES` only keeps out transactions of its own
/// node: an entry another node commits between the rotation's move and its truncate is in
/// the truncated slot. The promise: every acknowledged job not cancelled is claimed, once.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_rotations_on_one_node_lose_no_job_enqueued_claimed_or_cancelled_on_others() {
    use diesel::Connection;
    let db = ClusterDb::new();
    let stop = Arc::new(AtomicBool::new(false));
    let rotations = Arc::new(AtomicUsize::new(0));
    let rotator = {
        let (url, stop, rotations) = (db.urls[0].clone(), stop.clone(), rotations.clone());
        std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).expect("node 1");
            let mut errors = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match jobs::rotate_ready(&mut conn, Duration::ZERO) {
                    Ok(Some(_)) => {
                        rotations.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(None) => {}
                    Err(e) if e.is_retryable() => {}
                    Err(e) => {
                        errors.push(e.to_string());
                        conn = AnyConnection::connect(&url).expect("node 1");
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            errors
        })
    };
    // Node 2: enqueuers, half of them in an old read view.
    let acknowledged: Arc<Mutex<BTreeSet<i64>>> = Arc::default();
    let cancelled: Arc<Mutex<BTreeSet<i64>>> = Arc::default();
    let enqueuers: Vec<_> = (0..2)
        .map(|t| {
            let (url, stop, acknowledged, cancelled) = (
                db.urls[1].clone(),
                stop.clone(),
                acknowledged.clone(),
                cancelled.clone(),
            );
            std::thread::spawn(move || {
                let mut conn = AnyConnection::connect(&url).expect("node 2");
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let job = NewJob::new("ring", "k", vec![]);
                    let result: tenure::Result<i64> = if t == 0 {
                        // REPEATABLE READ (the session's default): the read view starts at the
                        // first read, before the rotations the sleep lets pass.
                        conn.transaction(|c| {
                            diesel::sql_query("SELECT generation AS n FROM tenure_ready_ring")
                                .get_result::<N>(c)?;
                            std::thread::sleep(Duration::from_millis(40 + n % 40));
                            Ok(jobs::enqueue(c, &job)?.id)
                        })
                    } else {
                        jobs::enqueue(&mut conn, &job).map(|e| e.id)
                    };
                    match result {
                        Ok(id) => {
                            acknowledged.lock().unwrap().insert(id);
                            if t == 1 && n % 4 == 0 {
                                match jobs::cancel(&mut conn, id) {
                                    Ok(true) => {
                                        cancelled.lock().unwrap().insert(id);
                                    }
                                    Ok(false) => {}
                                    Err(e) if e.is_retryable() => {}
                                    Err(e) => panic!("cancel: {e}"),
                                }
                            }
                        }
                        Err(e) if e.is_retryable() => {}
                        Err(e) => panic!("enqueue on node 2: {e}"),
                    }
                    std::thread::sleep(Duration::from_millis(3));
                }
            })
        })
        .collect();
    // Node 3: a claimer.
    let claimed: Arc<Mutex<Vec<i64>>> = Arc::default();
    // Claimed jobs whose completion was Done (not Cancelled: a cancel that found the job
    // running asked it to stop, and its completion then cancels it).
    let completed: Arc<Mutex<BTreeSet<i64>>> = Arc::default();
    let claimer_stop = Arc::new(AtomicBool::new(false));
    let claimer = {
        let (url, stop, claimed, completed) = (
            db.urls[2].clone(),
            claimer_stop.clone(),
            claimed.clone(),
            completed.clone(),
        );
        std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).expect("node 3");
            while !stop.load(Ordering::SeqCst) {
                let got = match jobs::claim(&mut conn, "ring", 10, TTL) {
                    Ok(got) => got,
                    Err(e) if e.is_retryable() => continue,
                    Err(e) => panic!("claim on node 3: {e}"),
                };
                if got.is_empty() {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                claimed.lock().unwrap().extend(got.iter().map(|j| j.id));
                let claims: Vec<_> = got.iter().map(|j| j.claim()).collect();
                let outcomes = complete_retrying(&mut conn, &claims);
                completed.lock().unwrap().extend(
                    got.iter()
                        .zip(outcomes)
                        .filter(|(_, o)| *o == Outcome::Done)
                        .map(|(j, _)| j.id),
                );
            }
        })
    };
    std::thread::sleep(Duration::from_secs(10));
    stop.store(true, Ordering::SeqCst);
    for e in enqueuers {
        e.join().expect("an enqueuer panicked");
    }
    let rotation_errors = rotator.join().expect("the rotator panicked");
    let expected: BTreeSet<i64> = acknowledged
        .lock()
        .unwrap()
        .difference(&cancelled.lock().unwrap())
        .copied()
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got: BTreeSet<i64> = claimed.lock().unwrap().iter().copied().collect();
        if expected.is_subset(&got) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    claimer_stop.store(true, Ordering::SeqCst);
    claimer.join().expect("the claimer panicked");
    let claimed = claimed.lock().unwrap();
    let twice: Vec<_> = claimed
        .iter()
        .fold(BTreeMap::<i64, usize>::new(), |mut n, id| {
            *n.entry(*id).or_default() += 1;
            n
        })
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    let got: BTreeSet<i64> = claimed.iter().copied().collect();
    let never: Vec<i64> = expected.difference(&got).copied().collect();
    let mut conn = AnyConnection::connect(&db.urls[2]).expect("node 3");
    let orphans = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs j WHERE j.state = 'waiting' \
         AND NOT EXISTS (SELECT 1 FROM tenure_ready r WHERE r.id = j.id)",
    );
    // A cancel that returned true while another node's claim took the job was a request
    // (the job was running): its completion must then say Cancelled. Done means the cancel
    // was lost.
    let cancelled_claimed: Vec<_> = cancelled
        .lock()
        .unwrap()
        .intersection(&got)
        .copied()
        .collect();
    let cancelled_completed: Vec<_> = cancelled
        .lock()
        .unwrap()
        .intersection(&completed.lock().unwrap())
        .copied()
        .collect();
    eprintln!(
        "Galera ring: {} rotations on node 1 ({} errors: {:?}); {} acknowledged on node 2, {} \
         cancelled; {} claimed on node 3; never claimed: {} ({:?}); waiting jobs without a ring \
         entry: {orphans}; claimed twice: {twice:?}; cancels that found the job claimed (requests): \
         {cancelled_claimed:?}, of which completed as Done: {cancelled_completed:?}",
        rotations.load(Ordering::SeqCst),
        rotation_errors.len(),
        rotation_errors.iter().take(3).collect::<Vec<_>>(),
        acknowledged.lock().unwrap().len(),
        cancelled.lock().unwrap().len(),
        got.len(),
        never.len(),
        never.iter().take(10).collect::<Vec<_>>(),
    );
    // Before the fix every node's commits stalled for good behind the first rotation's table
    // lock; a Galera node now declines to rotate (0 rotations), and nothing may be lost.
    assert_eq!(
        rotations.load(Ordering::SeqCst),
        0,
        "a Galera node rotated its ready ring (LOCK TABLES stalls the cluster)"
    );
    assert!(
        never.is_empty() && orphans == 0,
        "{} acknowledged jobs never claimed ({:?}); {orphans} waiting jobs have no ring entry",
        never.len(),
        never.iter().take(10).collect::<Vec<_>>()
    );
    assert!(twice.is_empty(), "claimed twice: {twice:?}");
    assert!(
        cancelled_completed.is_empty(),
        "cancelled, yet completed as if not: {cancelled_completed:?}"
    );
    assert!(
        rotation_errors.is_empty(),
        "rotations on node 1 failed: {rotation_errors:?}"
    );
}

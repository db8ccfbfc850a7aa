//! Attacks on what synchronous replication promises through a Patroni failover, beyond
//! patroni.rs (the cluster, its variables and helpers are there): a workflow's dependencies
//! completed from several threads while the primary switches over or dies, every completion
//! retried on a new connection until it answers (a retry whose first try committed on the old
//! primary just before it went); dedup keys enqueued from several threads around the failover;
//! a worker whose jobs must never run twice at once and which must resume by itself within a
//! bound; a lease guard whose ttl is shorter than the failover. Run by
//! `scripts/test-clusters patroni` (SYNC=1), one at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenure::jobs::{self, JobState, NewJob, Outcome};
use tenure::lease::{Take, Wait};
use tenure::worker::{JobContext, Worker};
use tenure::{AnyConnection, LeaseGuard, Pool};

use super::cluster_script;
use super::patroni::{ClusterDb, Killed, node_of};

/// Claims long enough that no rescue interferes: a claim comes back only if someone gives it.
const TTL: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, Debug)]
enum Failover {
    Switchover,
    KillPrimary,
}

/// Forces `failover` now; the returned guard restarts a killed node when dropped.
fn force(db: &ClusterDb, failover: Failover) -> Option<Killed> {
    match failover {
        Failover::Switchover => {
            cluster_script("cluster-postgres", &["failover"]);
            None
        }
        Failover::KillPrimary => {
            let primary = node_of(&mut connect(&db.url));
            Some(Killed::node(primary))
        }
    }
}

/// A connection to the primary, waiting out a failover (90 s at most).
fn connect(url: &str) -> AnyConnection {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match AnyConnection::connect(url) {
            Ok(conn) => return conn,
            Err(e) => {
                assert!(Instant::now() < deadline, "no primary for 90 s: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Runs `f` on a connection to the primary until it answers, on a new connection after each
/// error (a failover kills them), 90 s at most. Returns the answer and whether an error
/// left the outcome of an earlier try unknown.
fn until_answered<T>(
    url: &str,
    conn: &mut Option<AnyConnection>,
    mut f: impl FnMut(&mut AnyConnection) -> tenure::Result<T>,
) -> (T, bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut unknown = false;
    loop {
        if conn.is_none() {
            *conn = AnyConnection::connect(url).ok();
        }
        if let Some(c) = conn.as_mut() {
            match f(c) {
                Ok(answer) => return (answer, unknown),
                Err(e) => {
                    unknown |= e.is_outcome_unknown();
                    *conn = None;
                    assert!(Instant::now() < deadline, "no answer for 90 s, last: {e}");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One round: `WORKFLOWS` dependents of `DEPS` dependencies each; every dependency claimed;
/// four threads complete them one at a time, 150 ms apart, while `failover` hits. Returns
/// what went wrong (empty when everything held) and the figures.
fn dependencies_round(db: &ClusterDb, failover: Failover, round: usize) -> (Vec<String>, String) {
    const WORKFLOWS: usize = 24;
    const DEPS: usize = 8;
    let queue = format!("w{round}");
    let mut conn = connect(&db.url);
    let mut dependents = Vec::new();
    let mut deps_of = Vec::new();
    for _ in 0..WORKFLOWS {
        let deps: Vec<i64> = (0..DEPS)
            .map(|_| {
                jobs::enqueue(&mut conn, &NewJob::new(queue.as_str(), "dep", vec![]))
                    .unwrap()
                    .id
            })
            .collect();
        let job = NewJob::new(queue.as_str(), "after", vec![]).depends_on(deps.iter().copied());
        dependents.push(jobs::enqueue(&mut conn, &job).unwrap().id);
        deps_of.extend(deps);
    }
    let mut claimed = Vec::new();
    while claimed.len() < deps_of.len() {
        let got = jobs::claim(&mut conn, &queue, 100, TTL).unwrap();
        assert!(
            !got.is_empty(),
            "only {} dependencies claimable",
            claimed.len()
        );
        claimed.extend(got.into_iter().map(|j| j.claim()));
    }
    drop(conn);
    let mut shares = vec![Vec::new(); 4];
    for (i, claim) in claimed.iter().enumerate() {
        shares[i % 4].push(*claim);
    }
    // (job id, outcome, whether an earlier try's outcome was unknown)
    let outcomes: Arc<Mutex<Vec<(i64, Outcome, bool)>>> = Arc::default();
    let killed = std::thread::scope(|s| {
        for share in shares {
            let (url, outcomes) = (db.url.clone(), outcomes.clone());
            s.spawn(move || {
                let mut conn = None;
                for claim in share {
                    let (answer, unknown) =
                        until_answered(&url, &mut conn, |c| jobs::complete(c, &[claim]));
                    outcomes
                        .lock()
                        .unwrap()
                        .push((claim.id, answer[0], unknown));
                    std::thread::sleep(Duration::from_millis(150));
                }
            });
        }
        std::thread::sleep(Duration::from_millis(1500));
        force(db, failover)
    });
    let mut conn = connect(&db.url);
    let mut broken = Vec::new();
    let outcomes = outcomes.lock().unwrap().clone();
    let retried = outcomes.iter().filter(|o| o.2).count();
    let already = outcomes
        .iter()
        .filter(|o| o.1 == Outcome::AlreadyDone)
        .count();
    for (id, outcome, unknown) in &outcomes {
        if !matches!(outcome, Outcome::Done | Outcome::AlreadyDone) {
            broken.push(format!(
                "completing dependency {id} answered {outcome:?} (a try before had an unknown outcome: {unknown})"
            ));
        }
    }
    for id in &deps_of {
        let state = jobs::get(&mut conn, *id).unwrap().map(|j| j.state);
        if state != Some(JobState::Completed) {
            broken.push(format!("dependency {id} is {state:?}, not completed"));
        }
    }
    for id in &dependents {
        let state = jobs::get(&mut conn, *id).unwrap().map(|j| j.state);
        let pending = crate::common::count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_dependency_stripes \
                 WHERE job_id = {id} AND pending <> 0"
            ),
        );
        if state != Some(JobState::Waiting) || pending != 0 {
            broken.push(format!(
                "dependent {id} is {state:?} with {pending} stripes pending"
            ));
        }
    }
    let mut released: BTreeMap<i64, usize> = BTreeMap::new();
    loop {
        let got = jobs::claim(&mut conn, &queue, 100, TTL).unwrap();
        if got.is_empty() {
            break;
        }
        for job in got {
            *released.entry(job.id).or_default() += 1;
        }
    }
    let expected: BTreeSet<i64> = dependents.iter().copied().collect();
    let got: BTreeSet<i64> = released.keys().copied().collect();
    if got != expected || released.values().any(|n| *n != 1) {
        broken.push(format!(
            "dependents claimable: {released:?}, expected each of {expected:?} once"
        ));
    }
    drop(killed);
    let figures = format!(
        "round {round} ({failover:?}): {} completions, {retried} after a try with an unknown \
         outcome, {already} AlreadyDone",
        outcomes.len()
    );
    (broken, figures)
}

/// A workflow's dependencies completed from four threads while the primary switches over and
/// while it is killed, four rounds: every completion answers Done or AlreadyDone (a retry of
/// one whose commit the old primary acknowledged), each dependency is completed, each
/// dependent is waiting with no stripe pending and claimable exactly once.
#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_dependencies_completed_through_failovers_release_their_dependents_once() {
    let db = ClusterDb::new();
    let mut broken = Vec::new();
    for (round, failover) in [
        Failover::Switchover,
        Failover::KillPrimary,
        Failover::Switchover,
        Failover::KillPrimary,
    ]
    .into_iter()
    .enumerate()
    {
        let (b, figures) = dependencies_round(&db, failover, round);
        eprintln!("Patroni, dependencies: {figures}; broken: {}", b.len());
        broken.extend(b);
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Dedup keys enqueued around a failover: four threads enqueue keys 0..150 in order, 40 ms
/// apart, each enqueue repeated on a new connection until it answers. Every thread must get
/// the same job id for a key, and the queue must hold exactly one job per key.
fn dedup_around(failover: Failover) {
    const KEYS: usize = 150;
    let db = ClusterDb::new();
    let ids: Arc<Mutex<BTreeMap<usize, BTreeSet<i64>>>> = Arc::default();
    let unknown = Arc::new(AtomicUsize::new(0));
    let killed = std::thread::scope(|s| {
        for _ in 0..4 {
            let (url, ids, unknown) = (db.url.clone(), ids.clone(), unknown.clone());
            s.spawn(move || {
                let mut conn = None;
                for key in 0..KEYS {
                    let job = NewJob::new("d", "k", key.to_string().into_bytes())
                        .dedup_key(format!("key-{key}"));
                    let (enqueued, was_unknown) =
                        until_answered(&url, &mut conn, |c| jobs::enqueue(c, &job));
                    if was_unknown {
                        unknown.fetch_add(1, Ordering::SeqCst);
                    }
                    ids.lock()
                        .unwrap()
                        .entry(key)
                        .or_default()
                        .insert(enqueued.id);
                    std::thread::sleep(Duration::from_millis(40));
                }
            });
        }
        std::thread::sleep(Duration::from_secs(2));
        force(&db, failover)
    });
    let mut conn = connect(&db.url);
    let mut broken = Vec::new();
    for (key, ids) in ids.lock().unwrap().iter() {
        let jobs = crate::common::count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE dedup_key = 'key-{key}'"),
        );
        if ids.len() != 1 || jobs != 1 {
            broken.push((*key, ids.clone(), jobs));
        }
    }
    drop(killed);
    eprintln!(
        "Patroni, dedup keys ({failover:?}): {KEYS} keys x 4 enqueuers, {} enqueues retried \
         after an unknown outcome, {} keys broken",
        unknown.load(Ordering::SeqCst),
        broken.len()
    );
    assert!(
        broken.is_empty(),
        "(key, ids returned, jobs with the key): {broken:?}"
    );
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_dedup_keys_enqueued_through_a_switchover_make_one_job_each() {
    dedup_around(Failover::Switchover);
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_dedup_keys_enqueued_through_a_killed_primary_make_one_job_each() {
    dedup_around(Failover::KillPrimary);
}

fn pool(db: &ClusterDb, size: u32) -> Pool {
    Pool::options()
        .max_size(size)
        .connection_timeout(Duration::from_secs(60))
        .open(&db.url)
        .expect("a pool")
}

/// The bound this suite states for resuming: from the moment the failover script returned
/// (a new primary serves writes), a worker and an enqueuer that never restarted run and
/// acknowledge again within this long.
const RESUME_WITHIN: Duration = Duration::from_secs(20);

/// A worker (claims of 120 s, so that a claim whose answer was lost and which the worker
/// does not give back shows as a job stuck for two minutes) runs 300-ms jobs while an
/// enqueuer adds one every 150 ms, and `failover` hits. No job may run twice at the same
/// time; every acknowledged job completes within 60 s of the failover; the enqueuer and the
/// worker resume within [`RESUME_WITHIN`] of the new primary serving writes.
fn worker_through(failover: Failover) {
    let db = ClusterDb::new();
    let start = Instant::now();
    let running: Arc<Mutex<BTreeSet<i64>>> = Arc::default();
    let overlaps: Arc<Mutex<Vec<i64>>> = Arc::default();
    let runs: Arc<Mutex<Vec<(i64, Duration)>>> = Arc::default();
    let worker = {
        let (running, overlaps, runs) = (running.clone(), overlaps.clone(), runs.clone());
        Worker::builder(pool(&db, 6))
            .queue("r")
            .threads(3)
            .poll_interval(Duration::from_millis(50))
            .claim_ttl(Duration::from_secs(120))
            .raw_handler("k", move |ctx: &JobContext, _payload: &[u8]| {
                if !running.lock().unwrap().insert(ctx.id) {
                    overlaps.lock().unwrap().push(ctx.id);
                }
                std::thread::sleep(Duration::from_millis(300));
                running.lock().unwrap().remove(&ctx.id);
                runs.lock().unwrap().push((ctx.id, start.elapsed()));
                Ok(())
            })
            .start()
            .expect("a worker")
    };
    let stop = Arc::new(AtomicBool::new(false));
    let acknowledged: Arc<Mutex<Vec<(i64, Duration)>>> = Arc::default();
    let enqueuer = {
        let (pool, stop, acknowledged) = (pool(&db, 2), stop.clone(), acknowledged.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let outcome = pool
                    .get()
                    .and_then(|mut c| jobs::enqueue(&mut c, &NewJob::new("r", "k", vec![])));
                match outcome {
                    Ok(e) => acknowledged.lock().unwrap().push((e.id, start.elapsed())),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
                // Below the worker's pace (3 threads, 300 ms a job): no backlog, so a job
                // that waits long waits for its claim, not for a thread.
                std::thread::sleep(Duration::from_millis(150));
            }
        })
    };
    std::thread::sleep(Duration::from_secs(4));
    let forced_at = start.elapsed();
    let killed = force(&db, failover);
    // A killed primary's script returns at once: the new primary serves once a read-write
    // connection is had.
    drop(connect(&db.url));
    let served_at = start.elapsed();
    // Resumed: an enqueue acknowledged, and a run ended, after the new primary served.
    let deadline = Instant::now() + Duration::from_secs(90);
    let (enqueue_resumed, run_resumed) = loop {
        let first_enqueue = acknowledged
            .lock()
            .unwrap()
            .iter()
            .find(|(_, at)| *at > served_at)
            .map(|(_, at)| *at);
        let first_run = first_enqueue.and_then(|after| {
            runs.lock()
                .unwrap()
                .iter()
                .find(|(_, at)| *at > after)
                .map(|(_, at)| *at)
        });
        if let (Some(e), Some(r)) = (first_enqueue, first_run) {
            break (e - served_at, r - served_at);
        }
        assert!(Instant::now() < deadline, "nothing resumed within 90 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    enqueuer.join().unwrap();
    let acknowledged: BTreeMap<i64, Duration> =
        acknowledged.lock().unwrap().iter().copied().collect();
    // Every acknowledged job runs, long before its claim of 120 s could lapse.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ran: BTreeMap<i64, usize> = BTreeMap::new();
    while Instant::now() < deadline {
        ran.clear();
        for (id, _) in runs.lock().unwrap().iter() {
            *ran.entry(*id).or_default() += 1;
        }
        if acknowledged.keys().all(|id| ran.contains_key(id)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let all_done_at = start.elapsed();
    worker.shutdown(Duration::from_secs(10));
    drop(killed);
    let unrun: Vec<i64> = acknowledged
        .keys()
        .filter(|id| !ran.contains_key(id))
        .copied()
        .collect();
    let twice = ran.values().filter(|n| **n > 1).count();
    // The longest wait from an acknowledged enqueue to the end of its first run.
    let first_end: BTreeMap<i64, Duration> = runs
        .lock()
        .unwrap()
        .iter()
        .rev()
        .map(|(id, at)| (*id, *at))
        .collect();
    let longest_wait = acknowledged
        .iter()
        .filter_map(|(id, at)| first_end.get(id).map(|end| *end - *at))
        .max()
        .unwrap_or_default();
    let mut conn = connect(&db.url);
    let not_completed: Vec<i64> = acknowledged
        .keys()
        .filter(|id| {
            jobs::get(&mut conn, **id).unwrap().map(|j| j.state) != Some(JobState::Completed)
        })
        .copied()
        .collect();
    let overlaps = overlaps.lock().unwrap().clone();
    eprintln!(
        "Patroni, worker ({failover:?}): failover took {:.1} s; {} acknowledged, {} runs, {twice} \
         jobs ran more than once (one after the other), {} at the same time; enqueues \
         resumed {:.1} s and runs {:.1} s after the new primary served; everything ran {:.1} \
         s after; longest wait from an enqueue to its run {:.1} s; not run {}, not completed {}",
        (served_at - forced_at).as_secs_f64(),
        acknowledged.len(),
        runs.lock().unwrap().len(),
        overlaps.len(),
        enqueue_resumed.as_secs_f64(),
        run_resumed.as_secs_f64(),
        (all_done_at - served_at).as_secs_f64(),
        longest_wait.as_secs_f64(),
        unrun.len(),
        not_completed.len(),
    );
    assert!(overlaps.is_empty(), "jobs run twice at once: {overlaps:?}");
    assert!(
        unrun.is_empty(),
        "acknowledged jobs not run within 60 s: {unrun:?}"
    );
    assert!(not_completed.is_empty(), "not completed: {not_completed:?}");
    // A claim whose answer was lost and which the worker did not give back would hold its
    // job for the claim's 120 s.
    assert!(
        longest_wait < Duration::from_secs(45),
        "a job waited {longest_wait:?} from its enqueue to its run"
    );
    assert!(
        enqueue_resumed < RESUME_WITHIN && run_resumed < RESUME_WITHIN,
        "resumed only after {enqueue_resumed:?} (enqueues), {run_resumed:?} (runs)"
    );
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_worker_through_a_switchover_resumes_and_runs_nothing_twice_at_once() {
    worker_through(Failover::Switchover);
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_worker_through_a_killed_primary_resumes_and_runs_nothing_twice_at_once() {
    worker_through(Failover::KillPrimary);
}

/// A guard whose lease (`ttl`) is renewed across a failover, watched every 20 ms, and a taker
/// on another pool asking for the lease all along. When the taker is granted, the guard must
/// have said it lost the lease already; the taker's fence must be above the guard's.
fn guard_through(failover: Failover, ttl: Duration, fast_takeover: bool) {
    let db = ClusterDb::new();
    let start = Instant::now();
    let guard_pool = pool(&db, 2);
    let take = Take::new("g", ttl, "guard").fast_takeover(fast_takeover);
    let guard = Arc::new(Mutex::new(
        LeaseGuard::take_pooled_as(&guard_pool, &take)
            .unwrap()
            .expect("free"),
    ));
    let fence = guard.lock().unwrap().fence();
    let stop = Arc::new(AtomicBool::new(false));
    let lost_at: Arc<Mutex<Option<Duration>>> = Arc::default();
    let watcher = {
        let (guard, stop, lost_at) = (guard.clone(), stop.clone(), lost_at.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if !guard.lock().unwrap().is_held() {
                    lost_at.lock().unwrap().get_or_insert(start.elapsed());
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let taker = {
        let (pool, stop, guard) = (pool(&db, 2), stop.clone(), guard.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let wait = Take::new("g", Duration::from_secs(30), "taker")
                    .wait(Wait::up_to(Duration::from_secs(2)));
                if let Ok(Some(granted)) = LeaseGuard::take_pooled_as(&pool, &wait) {
                    let held = guard.lock().unwrap().is_held();
                    return Some((start.elapsed(), granted.fence(), held, granted));
                }
            }
            None
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let killed = force(&db, failover);
    drop(connect(&db.url));
    let served_at = start.elapsed();
    std::thread::sleep(ttl + Duration::from_secs(15));
    stop.store(true, Ordering::SeqCst);
    let granted = taker.join().unwrap();
    watcher.join().unwrap();
    drop(killed);
    let lost_at = *lost_at.lock().unwrap();
    let held_at_end = guard.lock().unwrap().is_held();
    eprintln!(
        "Patroni, guard ({failover:?}, ttl {ttl:?}, fast takeover {fast_takeover}): new \
         primary at {:.1} s; guard said lost at {:?}; taker granted at {:?} (fence {:?}, the \
         guard's {fence}, the guard held then: {:?}); guard held at the end: {held_at_end}",
        served_at.as_secs_f64(),
        lost_at.map(|d| d.as_secs_f64()),
        granted.as_ref().map(|g| g.0.as_secs_f64()),
        granted.as_ref().map(|g| g.1),
        granted.as_ref().map(|g| g.2),
    );
    if let Some((at, taker_fence, held, _)) = &granted {
        assert!(
            !held,
            "the taker was granted at {at:?} while the guard believed it held the lease \
             (guard said lost at {lost_at:?})"
        );
        assert!(
            *taker_fence > fence,
            "fence {taker_fence} not above {fence}"
        );
        assert!(
            lost_at.is_some_and(|lost| lost <= *at),
            "granted at {at:?}, guard said lost at {lost_at:?}"
        );
    }
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_guard_with_fast_takeover_through_a_killed_primary_is_never_a_second_holder() {
    guard_through(Failover::KillPrimary, Duration::from_secs(30), true);
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_guard_shorter_than_a_killed_primarys_failover_says_lost_before_a_grant() {
    guard_through(Failover::KillPrimary, Duration::from_secs(8), false);
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_guard_with_fast_takeover_through_a_switchover_is_never_a_second_holder() {
    guard_through(Failover::Switchover, Duration::from_secs(30), true);
}

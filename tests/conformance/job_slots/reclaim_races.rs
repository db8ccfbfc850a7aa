//! Races on PostgreSQL's retention by slot (`jobs::reclaim_job_slots`,
//! tenure-0056's `tenure_reclaim_job_slot`): finishes racing the reclaim's lock (they
//! deadlocked with it: fixed), a reclaim meeting a row lock under its lock (it waited without
//! bound: fixed), KeepNewest whose newest jobs sit in an old slot, a caller's open
//! transaction that inserted into a slot the rotation moved past, a REPEATABLE READ
//! dependent of a reclaimed job, `retry_dead` racing a reclaim, two reclaimers with
//! different policies.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, Finished, NewJob, Retention};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

use super::{delete_all, exclusive_lock_on, fill_cancelled, rotate, slot_of};

const TTL: Duration = Duration::from_secs(600);

/// Attacks: a reclaim that, holding its slot's ACCESS EXCLUSIVE lock, meets a row lock on a
/// row beside its jobs (here a caller's `SELECT ... FROM tenure_job_results ... FOR SHARE`
/// kept open; the crate's own case is a finish's edge lock, the tests above). It waited
/// without bound (`lock_timeout` 0 once it held the slot): an enqueue depending on a job of
/// the CURRENT slot waited 3,007 ms behind it, until the test killed it, since its
/// dependency lookup reads through the parent, every partition. Now it waits 20 ms for such
/// a lock, then gives up and lets the slot go: reclaims tried over and over while the row
/// lock is held take nothing, statements on the current slot's jobs go on, and once the row
/// lock is gone the next reclaim takes the slot, every row beside its jobs with it.
#[test]
fn postgres_a_reclaim_meeting_a_row_lock_under_its_lock_gives_up() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(
            jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
                .unwrap()
                .id,
        );
    }
    for _ in 0..20 {
        let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
        jobs::complete_with_result(&mut conn, c.claim(), &jobs::JobResult::json(&1).unwrap())
            .unwrap();
    }
    assert_eq!(rotate(&mut conn), Some(1));
    let current = jobs::enqueue(&mut conn, &NewJob::new("cur", "a", vec![]))
        .unwrap()
        .id;
    assert_eq!(slot_of(&mut conn, current), 1);
    let results_before = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_results");

    let mut holder = db.connect_raw();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT * FROM tenure_job_results WHERE job_id = {} FOR SHARE",
            ids[19]
        ))
        .unwrap();
    // Reclaims as fast as they go while the row lock is held.
    let stop = Arc::new(AtomicBool::new(false));
    let reclaimer = {
        let (url, stop) = (db.url().to_string(), stop.clone());
        std::thread::spawn(move || {
            let mut c = AnyConnection::connect(&url).unwrap();
            let (mut calls, mut slots) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                slots += jobs::reclaim_job_slots(&mut c, &delete_all(&["q"]))
                    .unwrap()
                    .slots;
                calls += 1;
            }
            (calls, slots)
        })
    };
    // Statements on the current slot's jobs, each on its own connection.
    type Probe = Box<dyn FnOnce(&mut AnyConnection) -> String + Send>;
    let probes: Vec<(&str, Probe)> = vec![
        (
            "claim of a current-slot job",
            Box::new(|c: &mut AnyConnection| {
                format!("{:?}", jobs::claim(c, "cur", 1, TTL).map(|v| v.len()))
            }),
        ),
        (
            "enqueue depending on a current-slot job",
            Box::new(move |c: &mut AnyConnection| {
                format!(
                    "{:?}",
                    jobs::enqueue(c, &NewJob::new("cur", "b", vec![]).depends_on([current]))
                        .map(|e| e.id)
                )
            }),
        ),
        (
            "plain enqueue",
            Box::new(|c: &mut AnyConnection| {
                format!(
                    "{:?}",
                    jobs::enqueue(c, &NewJob::new("cur", "c", vec![])).map(|e| e.id)
                )
            }),
        ),
    ];
    let threads: Vec<_> = probes
        .into_iter()
        .map(|(name, probe)| {
            let url = db.url().to_string();
            let thread = std::thread::spawn(move || {
                let mut c = AnyConnection::connect(&url).unwrap();
                probe(&mut c)
            });
            (name, thread)
        })
        .collect();
    // Each done while the row lock is still held (30 s: a blocked one waits for ever).
    let deadline = Instant::now() + Duration::from_secs(30);
    while threads.iter().any(|(_, t)| !t.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let waited: Vec<&str> = threads
        .iter()
        .filter(|(_, t)| !t.is_finished())
        .map(|(name, _)| *name)
        .collect::<Vec<_>>();
    // The reclaimer has had its tries by now, each meeting the row lock.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let (calls, slots) = reclaimer.join().unwrap();
    holder.batch_execute("COMMIT").unwrap();
    for (name, t) in threads {
        eprintln!("{name}: {}", t.join().unwrap());
    }
    eprintln!("{calls} reclaims while the row lock was held took {slots} slots");
    assert!(
        waited.is_empty(),
        "statements on the current slot's jobs waited 30 s behind a reclaim blocked under \
         its exclusive lock of another slot: {waited:?}"
    );
    assert_eq!(
        slots, 0,
        "a reclaim took the slot while a row beside its jobs was locked"
    );
    // Nothing of slot 0 went meanwhile.
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id IN ({list})")
        ),
        20
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_results"),
        results_before
    );
    // The row lock gone, the next reclaim takes the slot and the rows beside its jobs.
    assert_eq!(
        jobs::reclaim_job_slots(&mut conn, &delete_all(&["q"]))
            .unwrap()
            .slots,
        1
    );
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id IN ({list})")
        ),
        0
    );
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_job_results WHERE job_id IN ({list})")
        ),
        0
    );
    assert_eq!(slot_of(&mut conn, current), 1);
}

/// Attacks: KeepNewest(3) where the newest jobs sit in an old slot (slot 0 holds the oldest
/// and, finished last, the newest; slot 1 the middle; slot 2 current). After reclaims and
/// rotations, at least the 3 newest are still there.
/// FOUND: PASSES (slot 0 held by its newest; slot 1's jobs are all older than the cutoff and
/// go; the 3 newest stay).
#[test]
fn postgres_keep_newest_keeps_its_newest_jobs_in_an_old_slot() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let mut slot0 = Vec::new();
    for _ in 0..6 {
        slot0.push(
            jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
                .unwrap()
                .id,
        );
    }
    // Three of slot 0 finish first (oldest).
    for _ in 0..3 {
        let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
        jobs::complete(&mut conn, &[c.claim()]).unwrap();
    }
    let late: Vec<_> = jobs::claim(&mut conn, "q", 3, TTL).unwrap();
    assert_eq!(rotate(&mut conn), Some(1));
    let mut slot1 = Vec::new();
    for _ in 0..5 {
        slot1.push(
            jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]))
                .unwrap()
                .id,
        );
    }
    for _ in 0..5 {
        let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
        std::thread::sleep(Duration::from_millis(2));
        jobs::complete(&mut conn, &[c.claim()]).unwrap();
    }
    // The newest three: slot 0's late ones.
    for c in &late {
        std::thread::sleep(Duration::from_millis(2));
        jobs::complete(&mut conn, &[c.claim()]).unwrap();
    }
    assert_eq!(rotate(&mut conn), Some(2));
    let policies = vec![(
        "q".to_string(),
        Finished::Completed,
        Retention::KeepNewest(3),
    )];
    for _ in 0..3 {
        jobs::reclaim_job_slots(&mut conn, &policies).unwrap();
        rotate(&mut conn);
    }
    let late_ids = late
        .iter()
        .map(|c| c.id.to_string())
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id IN ({late_ids})")
        ),
        3,
        "KeepNewest(3)'s newest three went"
    );
    eprintln!(
        "left: {}",
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs")
    );
}

/// Attacks: a caller's open transaction (`tenure::transaction`) enqueued into slot 0
/// (waiting) and stays open while the slots turn past it and every other job of slot 0
/// finishes; reclaims run meanwhile (the uncommitted job is invisible to their checks).
/// Then the caller commits.
/// FOUND: PASSES (the caller's insert holds a lock on slot 0: the reclaim's lock is refused,
/// the slot stays, the job is claimed after the commit).
#[test]
fn postgres_a_callers_open_insert_holds_a_slot_the_rotation_moved_past() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let done = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let (tx, rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let url = db.url().to_string();
    let caller = std::thread::spawn(move || {
        let mut c = AnyConnection::connect(&url).unwrap();
        tenure::transaction(&mut c, |c| {
            let late = jobs::enqueue(c, &NewJob::new("q", "late", vec![]))?.id;
            tx.send(late).unwrap();
            go_rx.recv().unwrap();
            Ok::<_, tenure::Error>(late)
        })
        .unwrap()
    });
    let late = rx.recv().unwrap();
    let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
    assert_eq!(c.id, done);
    jobs::complete(&mut conn, &[c.claim()]).unwrap();
    assert_eq!(rotate(&mut conn), Some(1));
    let mut reclaimed = 0;
    for _ in 0..5 {
        reclaimed += jobs::reclaim_job_slots(&mut conn, &delete_all(&["q"]))
            .unwrap()
            .slots;
    }
    go_tx.send(()).unwrap();
    assert_eq!(caller.join().unwrap(), late);
    assert_eq!(
        reclaimed, 0,
        "the slot holding the caller's uncommitted job was truncated"
    );
    assert_eq!(slot_of(&mut conn, late), 0);
    let got = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![late]);
}

/// Attacks: a REPEATABLE READ caller (`tenure::transaction`, isolation set first) whose
/// snapshot predates the completion of P and the reclaim of P's slot (taken without touching
/// tenure_jobs) enqueues a dependent of P after the slot is truncated. What must not happen:
/// a dependent accepted and left blocked for ever (its dependency gone, nothing to release
/// it), or one accepted as waiting with a dangling edge.
/// FOUND: PASSES. The enqueue is refused (`InvalidInput { field: "dependencies", reason:
/// "there is no job N ..." }`: the truncated slot looks empty to the old snapshot); nothing
/// is left blocked. (Against a row prune the same caller would see P in its snapshot and get
/// a serialization failure instead: a different error, not a break.)
#[test]
fn postgres_a_repeatable_read_dependent_of_a_reclaimed_job_is_refused() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let p = jobs::enqueue(&mut conn, &NewJob::new("q", "p", vec![]))
        .unwrap()
        .id;
    let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
    assert_eq!(rotate(&mut conn), Some(1));
    let (tx, rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let url = db.url().to_string();
    let caller = std::thread::spawn(move || {
        let mut c = AnyConnection::connect(&url).unwrap();
        tenure::transaction(&mut c, |c| {
            c.batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")?;
            let _ = count(c, "SELECT COUNT(*) AS n FROM tenure_workflows");
            tx.send(()).unwrap();
            go_rx.recv().unwrap();
            jobs::enqueue(c, &NewJob::new("q2", "d", vec![]).depends_on([p])).map(|e| e.id)
        })
    });
    rx.recv().unwrap();
    jobs::complete(&mut conn, &[c.claim()]).unwrap();
    assert_eq!(
        jobs::reclaim_job_slots(&mut conn, &delete_all(&["q"]))
            .unwrap()
            .slots,
        1
    );
    go_tx.send(()).unwrap();
    let enqueued = caller.join().unwrap();
    eprintln!("RR dependent of a reclaimed job: {enqueued:?}");
    if let Ok(d) = enqueued {
        let blocked = count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {d} AND state = 'blocked'"),
        );
        assert_eq!(
            blocked, 0,
            "a dependent of a reclaimed job was left blocked for ever"
        );
    }
}

/// Attacks: `retry_dead` of a dead job D (which depends on a completed P of an older slot)
/// sitting in a non-current slot with 60,000 other finished jobs, started the moment the
/// reclaim's ACCESS EXCLUSIVE lock on D's slot is seen granted, several rounds. What must
/// not happen: `retry_dead` answering `true` (revived) for a job the reclaim then truncated,
/// or either call failing.
/// FOUND: PASSES (4 of 4 rounds: `retry_dead` waits ~50 ms behind the lock and answers
/// `Ok(false)`, the job gone with its slot; never `true` for a truncated job).
#[test]
fn postgres_retry_dead_racing_the_reclaim_of_its_slot_never_revives_a_reclaimed_job() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let mut watcher = db.connect();
    let mut outcomes = Vec::new();
    for round in 0..4 {
        let p = jobs::enqueue(&mut conn, &NewJob::new("q", "p", vec![]))
            .unwrap()
            .id;
        let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
        jobs::complete(&mut conn, &[c.claim()]).unwrap();
        assert!(rotate(&mut conn).is_some());
        let d = jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "d", vec![])
                .depends_on([p])
                .max_attempts(1),
        )
        .unwrap()
        .id;
        let c = jobs::claim(&mut conn, "q", 1, TTL).unwrap().remove(0);
        assert_eq!(c.id, d);
        jobs::fail(&mut conn, c.claim(), "boom", jobs::Retry::Never).unwrap();
        let d_slot = slot_of(&mut conn, d);
        fill_cancelled(&mut conn, d_slot, "q", 60_000);
        assert!(rotate(&mut conn).is_some());
        let url = db.url().to_string();
        let reclaimer = std::thread::spawn(move || {
            let mut c = AnyConnection::connect(&url).unwrap();
            jobs::reclaim_job_slots(&mut c, &delete_all(&["q"])).map_err(|e| e.to_string())
        });
        let started = Instant::now();
        while !exclusive_lock_on(&mut watcher, d_slot)
            && started.elapsed() < Duration::from_secs(20)
        {}
        let began = Instant::now();
        let retried = jobs::retry_dead(&mut conn, d);
        let took = began.elapsed();
        let reclaimed = reclaimer.join().unwrap();
        let exists = count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {d}"),
        );
        outcomes.push(format!(
            "round {round}: retry_dead {retried:?} in {} ms, reclaim {reclaimed:?}, D exists {exists}",
            took.as_millis()
        ));
        // Let the slots turn for the next round.
        while let Ok(mut v) = jobs::claim(&mut conn, "q", 100, TTL) {
            if v.is_empty() {
                break;
            }
            let claims: Vec<_> = v.drain(..).map(|j| j.claim()).collect();
            jobs::complete(&mut conn, &claims).unwrap();
        }
        while jobs::reclaim_job_slots(&mut conn, &delete_all(&["q"]))
            .unwrap()
            .slots
            > 0
        {}
    }
    eprintln!("{outcomes:#?}");
    for o in &outcomes {
        assert!(o.contains("reclaim Ok("), "{outcomes:#?}");
        assert!(!o.contains("retry_dead Err"), "{outcomes:#?}");
        assert!(
            !(o.contains("retry_dead Ok(true)") && o.contains("D exists 0")),
            "a job retry_dead revived was truncated: {outcomes:#?}"
        );
    }
}

/// Attacks: two workers' reclaims with different policies (one names queue "q" only, the
/// other "r" only) and a rotator, all racing, over slots that hold finished jobs of both
/// queues, while a producer and a claimer keep both queues moving. What must not happen: a
/// reclaim truncating a slot that holds a job of the queue its policies do not name (a
/// finished "r" job under the "q" reclaimer, or the reverse), or any job lost before it ran.
/// FOUND: PASSES (every job ran once; finished jobs of both queues are only ever deleted by
/// no one: a slot holding both never goes, which is the documented limitation (2), not a
/// break).
#[test]
fn postgres_two_reclaimers_with_different_policies_take_no_job_either_keeps() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let db = TestDb::migrated(Backend::Postgres);
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for queues in [vec!["q"], vec!["r"]] {
        let (url, stop) = (db.url().to_string(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = AnyConnection::connect(&url).unwrap();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += jobs::reclaim_job_slots(&mut c, &delete_all(&queues))
                    .unwrap()
                    .slots;
                jobs::rotate_job_slots(&mut c, Duration::ZERO).unwrap();
            }
            n
        }));
    }
    let enqueued = Arc::new(Mutex::new(Vec::new()));
    let ran = Arc::new(Mutex::new(Vec::new()));
    let producer = {
        let (url, enqueued) = (db.url().to_string(), enqueued.clone());
        std::thread::spawn(move || {
            let mut c = AnyConnection::connect(&url).unwrap();
            for i in 0..600 {
                let queue = if i % 3 == 0 { "r" } else { "q" };
                let id = jobs::enqueue(&mut c, &NewJob::new(queue, "a", vec![]))
                    .unwrap()
                    .id;
                enqueued.lock().unwrap().push(id);
            }
        })
    };
    let claimer = {
        let (url, ran, stop) = (db.url().to_string(), ran.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = AnyConnection::connect(&url).unwrap();
            let mut idle = 0;
            while idle < 200 {
                let mut got = 0;
                for queue in ["q", "r"] {
                    let batch = jobs::claim(&mut c, queue, 10, TTL).unwrap();
                    got += batch.len();
                    let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
                    if !claims.is_empty() {
                        let done = jobs::complete(&mut c, &claims).unwrap();
                        assert!(done.iter().all(|o| *o == jobs::Outcome::Done), "{done:?}");
                    }
                    ran.lock().unwrap().extend(batch.iter().map(|j| j.id));
                }
                if got == 0 {
                    idle += 1;
                    std::thread::sleep(Duration::from_millis(10));
                } else {
                    idle = 0;
                }
            }
            stop.store(true, Ordering::Relaxed);
        })
    };
    producer.join().unwrap();
    claimer.join().unwrap();
    let reclaimed: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut enqueued = enqueued.lock().unwrap().clone();
    let mut ran = ran.lock().unwrap().clone();
    enqueued.sort_unstable();
    ran.sort_unstable();
    eprintln!(
        "reclaimed by each: {reclaimed:?}; {} enqueued, {} ran",
        enqueued.len(),
        ran.len()
    );
    assert_eq!(ran, enqueued, "a job was lost or ran twice");
    // A queue whose reclaimer truncated nothing has every finished job still there.
    let mut conn = db.connect();
    for (queue, n) in [("q", reclaimed[0]), ("r", reclaimed[1])] {
        let left = count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{queue}'"),
        );
        let made = enqueued.len() as i64 / 3 * if queue == "q" { 2 } else { 1 };
        if n == 0 {
            assert_eq!(
                left, made,
                "{queue}'s jobs went though its reclaimer took no slot"
            );
        }
    }
}

//! Fair claiming across tenants ([`NewJob::fair_key`]): a tenant that arrives behind another's
//! backlog waits for about one job per tenant, not for the backlog; weights share a queue in
//! proportion; a lone tenant gets all the capacity; a tenant's concurrent producers never
//! share a stamp. The negative control runs the same race without fair keys: the late
//! tenants wait behind the whole backlog.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, NewJob, Retry};

mod edges;
mod races;
mod turns;

use crate::common::{TestDb, conformance, count, enqueue_id};

conformance!(
    late_tenants_wait_for_a_job_per_tenant_not_for_the_backlog,
    negative_control_without_fair_keys_late_tenants_wait_behind_the_backlog,
    weights_share_the_queue_in_proportion,
    a_lone_tenant_gets_all_the_capacity,
    one_tenant_s_concurrent_producers_never_share_a_stamp,
    a_retried_job_keeps_its_tenant_s_place,
    a_claim_of_some_kinds_is_fair_too,
    bad_fair_input_is_refused_and_changes_nothing,
);

const TTL: Duration = Duration::from_secs(600);
const CLAIMERS: usize = 8;
const BACKLOG: usize = 1_500;
const LATE_TENANTS: usize = 9;
const PER_LATE_TENANT: usize = 10;

/// Tenant A's `BACKLOG` jobs wait; `CLAIMERS` threads on their own connections claim and
/// complete one job at a time, numbering claims as they return; once 200 are claimed, nine
/// tenants enqueue `PER_LATE_TENANT` jobs each from their own threads (with fair keys when
/// `fair`). Returns, per late job, how many claims were made between its enqueue (the count
/// read before it) and its claim.
fn late_tenants_race(backend: Backend, fair: bool) -> Vec<usize> {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = |tenant: &str| {
        let job = NewJob::new("fair", "work", tenant.as_bytes().to_vec());
        if fair { job.fair_key(tenant) } else { job }
    };
    let backlog: Vec<NewJob> = (0..BACKLOG).map(|_| job("a")).collect();
    for chunk in backlog.chunks(500) {
        jobs::enqueue_many(&mut conn, chunk).unwrap();
    }
    let claims = Arc::new(AtomicUsize::new(0));
    let late: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let waits: Arc<Mutex<Vec<usize>>> = Arc::default();
    let enqueued_late = Arc::new(AtomicBool::new(false));
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let (claims, late, waits, enqueued_late) = (
                claims.clone(),
                late.clone(),
                waits.clone(),
                enqueued_late.clone(),
            );
            std::thread::spawn(move || {
                loop {
                    let all_late_claimed =
                        enqueued_late.load(Ordering::SeqCst) && late.lock().unwrap().is_empty();
                    if all_late_claimed {
                        return;
                    }
                    let claimed = jobs::claim(&mut conn, "fair", 1, TTL).unwrap();
                    let Some(run) = claimed.into_iter().next() else {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    let position = claims.fetch_add(1, Ordering::SeqCst) + 1;
                    if let Some(before) = late.lock().unwrap().remove(&run.id) {
                        waits.lock().unwrap().push(position - before);
                    }
                    jobs::complete(&mut conn, &[run.claim()]).unwrap();
                }
            })
        })
        .collect();
    while claims.load(Ordering::SeqCst) < 200 {
        std::thread::sleep(Duration::from_millis(2));
    }
    let producers: Vec<_> = (0..LATE_TENANTS)
        .map(|t| {
            let mut conn = db.connect();
            let (claims, late) = (claims.clone(), late.clone());
            let tenant = format!("t{t}");
            let job = job(&tenant);
            std::thread::spawn(move || {
                for _ in 0..PER_LATE_TENANT {
                    // The count is read before the enqueue, and the job listed before any
                    // claim can return it (under the lock the claimers take to look it up).
                    let mut late = late.lock().unwrap();
                    let before = claims.load(Ordering::SeqCst);
                    let id = enqueue_id(&mut conn, job.clone());
                    late.insert(id, before);
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    enqueued_late.store(true, Ordering::SeqCst);
    for claimer in claimers {
        claimer.join().unwrap();
    }
    let waits = waits.lock().unwrap().clone();
    assert_eq!(waits.len(), LATE_TENANTS * PER_LATE_TENANT);
    waits
}

/// Ten tenants take turns: a late tenant's tenth job is claimed after at most about ten
/// rounds of ten jobs, plus the claims in flight on the eight claimers and the jobs running
/// when it arrived. The backlog ahead of it is 1,300 jobs.
const LATE_BOUND: usize = (LATE_TENANTS + 1) * PER_LATE_TENANT + 3 * CLAIMERS;

fn late_tenants_wait_for_a_job_per_tenant_not_for_the_backlog(backend: Backend) {
    let waits = late_tenants_race(backend, true);
    let worst = waits.iter().max().copied().unwrap_or(0);
    assert!(
        worst <= LATE_BOUND,
        "a late tenant's job waited {worst} claims (bound {LATE_BOUND}): {waits:?}"
    );
}

fn negative_control_without_fair_keys_late_tenants_wait_behind_the_backlog(backend: Backend) {
    let waits = late_tenants_race(backend, false);
    let best = waits.iter().min().copied().unwrap_or(0);
    assert!(
        best > LATE_BOUND * 5,
        "without fair keys a late job waited only {best} claims: {waits:?}"
    );
}

fn weights_share_the_queue_in_proportion(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::set_fair_weight(&mut conn, "w", "heavy", 3).unwrap();
    let batch: Vec<NewJob> = (0..400)
        .flat_map(|_| ["heavy", "light"])
        .map(|tenant| NewJob::new("w", tenant, vec![]).fair_key(tenant))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let mut heavy = 0;
    for _ in 0..10 {
        let claimed = jobs::claim(&mut conn, "w", 20, TTL).unwrap();
        heavy += claimed.iter().filter(|job| job.kind == "heavy").count();
    }
    // 200 claims at 3:1: 150 heavy, give or take the tie at each round's edge.
    assert!((149..=151).contains(&heavy), "heavy took {heavy} of 200");
    // A weight changed is recorded (for the tenant's jobs enqueued afterwards).
    jobs::set_fair_weight(&mut conn, "w", "light", 3).unwrap();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_fair_keys WHERE fair_key = 'light' AND weight = 3"
        ),
        1
    );
}

fn a_lone_tenant_gets_all_the_capacity(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..300)
        .map(|_| NewJob::new("lone", "work", vec![]).fair_key("only"))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    // Every claim while jobs wait takes as many as it asks for: nothing is held back for
    // tenants that have nothing waiting.
    for _ in 0..30 {
        assert_eq!(jobs::claim(&mut conn, "lone", 10, TTL).unwrap().len(), 10);
    }
    assert!(jobs::claim(&mut conn, "lone", 10, TTL).unwrap().is_empty());
}

fn one_tenant_s_concurrent_producers_never_share_a_stamp(backend: Backend) {
    let db = TestDb::migrated(backend);
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let mut conn = db.connect();
            std::thread::spawn(move || {
                for _ in 0..25 {
                    if t % 2 == 0 {
                        enqueue_id(&mut conn, NewJob::new("p", "work", vec![]).fair_key("t"));
                    } else {
                        let batch = vec![NewJob::new("p", "work", vec![]).fair_key("t"); 2];
                        jobs::enqueue_many(&mut conn, &batch).unwrap();
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let mut conn = db.connect();
    let jobs_made = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs");
    assert_eq!(jobs_made, 3 * 25 + 3 * 50);
    let distinct = count(
        &mut conn,
        "SELECT COUNT(DISTINCT fair_stamp) AS n FROM tenure_jobs",
    );
    assert_eq!(distinct, jobs_made, "two jobs of one tenant share a stamp");
    // Nothing ran, so the tenant's stamps are its turns one after another.
    assert_eq!(
        count(&mut conn, "SELECT MAX(fair_stamp) AS n FROM tenure_jobs"),
        jobs_made * 1_000_000
    );
}

fn a_retried_job_keeps_its_tenant_s_place(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let backlog: Vec<NewJob> = (0..50)
        .map(|_| NewJob::new("r", "a", vec![]).fair_key("a"))
        .collect();
    jobs::enqueue_many(&mut conn, &backlog).unwrap();
    let b = enqueue_id(&mut conn, NewJob::new("r", "b", vec![]).fair_key("b"));
    let first = jobs::claim(&mut conn, "r", 3, TTL).unwrap();
    let run = first
        .iter()
        .find(|job| job.id == b)
        .expect("b claimed in the first round");
    jobs::fail(
        &mut conn,
        run.claim(),
        "flaky",
        Retry::After(Duration::ZERO),
    )
    .unwrap();
    // Its place is b's first turn, ahead of all but a round of a's 47 waiting jobs.
    let next = jobs::claim(&mut conn, "r", 3, TTL).unwrap();
    assert!(
        next.iter().any(|job| job.id == b),
        "the retried job lost its place: {:?}",
        next.iter().map(|job| job.kind.as_str()).collect::<Vec<_>>()
    );
}

fn a_claim_of_some_kinds_is_fair_too(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let backlog: Vec<NewJob> = (0..200)
        .map(|_| NewJob::new("k", "pull", vec![]).fair_key("a"))
        .collect();
    jobs::enqueue_many(&mut conn, &backlog).unwrap();
    let late: BTreeSet<i64> = (0..3)
        .map(|t| {
            enqueue_id(
                &mut conn,
                NewJob::new("k", "pull", vec![]).fair_key(format!("t{t}")),
            )
        })
        .collect();
    let claimed = jobs::claim_kinds(&mut conn, "k", &["pull", "push"], 8, TTL).unwrap();
    let got: BTreeSet<i64> = claimed.iter().map(|job| job.id).collect();
    assert!(
        late.is_subset(&got),
        "late tenants' jobs not among the first 8"
    );
}

fn bad_fair_input_is_refused_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for key in [String::new(), "x".repeat(256), "a\0b".to_string()] {
        let job = NewJob::new("bad", "work", vec![]).fair_key(key.clone());
        let error = jobs::enqueue(&mut conn, &job).unwrap_err();
        assert!(error.is_invalid_input(), "{key:?}: {error}");
        let error = jobs::enqueue_many(&mut conn, &[job]).unwrap_err();
        assert!(error.is_invalid_input(), "{key:?}: {error}");
        let error = jobs::set_fair_weight(&mut conn, "bad", &key, 2).unwrap_err();
        assert!(error.is_invalid_input(), "{key:?}: {error}");
    }
    for weight in [0, jobs::MAX_FAIR_WEIGHT + 1] {
        let error = jobs::set_fair_weight(&mut conn, "bad", "t", weight).unwrap_err();
        assert!(error.is_invalid_input(), "{weight}: {error}");
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_fair_keys"),
        0
    );
}

//! Fair claiming, what a tenant's turns count and what holds them (a duplicate folded
//! into its live job, a cancelled backlog, jobs scheduled for later, a backlog at another
//! priority), what must not hold the virtual time back (a job its limit holds), and the
//! guarantees that must hold with fair jobs (the ring's rotation, a rolled-back enqueue,
//! exhausted stamps, concurrent batches of overlapping tenants, many tenants and claimers).
//! Jobs' kinds name their tenants.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use diesel::RunQueryDsl;
use tenure::Backend;
use tenure::jobs::{self, ClaimedJob, NewJob};

use crate::common::{TestDb, conformance, count, enqueue_id};

conformance!(
    folded_duplicates_do_not_spend_their_tenant_s_turns,
    a_cancelled_backlog_does_not_push_its_tenant_s_next_job_behind_others,
    jobs_scheduled_for_later_do_not_push_their_tenant_s_due_job_behind_others,
    a_backlog_at_another_priority_does_not_push_an_urgent_job_behind_others,
    a_job_its_limit_holds_does_not_hand_a_newcomer_the_whole_queue,
    the_ring_s_rotation_keeps_the_turns,
    a_rolled_back_enqueue_leaves_its_tenant_s_turns,
    exhausted_stamps_are_a_typed_error_and_change_nothing,
    concurrent_batches_of_overlapping_tenants_in_any_order,
    concurrent_batches_in_callers_transactions_never_deadlock,
    a_thousand_tenants_and_eight_claimers_take_turns,
);

const TTL: Duration = Duration::from_secs(600);

fn fair(queue: &str, tenant: &str) -> NewJob {
    NewJob::new(queue, tenant, vec![]).fair_key(tenant)
}

fn backlog(conn: &mut tenure::AnyConnection, queue: &str, tenant: &str, n: usize) -> Vec<i64> {
    let batch: Vec<NewJob> = (0..n).map(|_| fair(queue, tenant)).collect();
    jobs::enqueue_many(conn, &batch)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect()
}

fn claim_and_complete(conn: &mut tenure::AnyConnection, queue: &str, n: usize) -> Vec<ClaimedJob> {
    let claimed = jobs::claim(conn, queue, n, TTL).unwrap();
    let claims: Vec<_> = claimed.iter().map(|job| job.claim()).collect();
    if !claims.is_empty() {
        jobs::complete(conn, &claims).unwrap();
    }
    claimed
}

fn kinds(claimed: &[ClaimedJob]) -> Vec<&str> {
    claimed.iter().map(|job| job.kind.as_str()).collect()
}

/// The tenant's last turn: the greatest stamp of its waiting jobs (its kind), -1 for none.
fn last_stamp(conn: &mut tenure::AnyConnection, queue: &str, key: &str) -> i64 {
    count(
        conn,
        &format!(
            "SELECT COALESCE(MAX(fair_stamp), -1) AS n FROM tenure_jobs \
             WHERE queue = '{queue}' AND kind = '{key}' AND state = 'waiting'"
        ),
    )
}

/// A job enqueued 50 times with one dedup key is one job: one turn. Its tenant's next job
/// must take its turn among the others', not 49 turns later.
fn folded_duplicates_do_not_spend_their_tenant_s_turns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    backlog(&mut conn, "f", "a", 200);
    for _ in 0..50 {
        jobs::enqueue(&mut conn, &fair("f", "x").dedup_key("sync-x")).unwrap();
    }
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = 'x'"
        ),
        1
    );
    let first = claim_and_complete(&mut conn, "f", 3);
    assert!(kinds(&first).contains(&"x"), "{:?}", kinds(&first));
    let next_x = enqueue_id(&mut conn, fair("f", "x"));
    let next = claim_and_complete(&mut conn, "f", 3);
    assert!(
        next.iter().any(|job| job.id == next_x),
        "x's next job waits behind a's backlog: its 49 folded duplicates spent its turns \
         (last stamp {}, claimed {:?})",
        last_stamp(&mut conn, "f", "x"),
        kinds(&next)
    );
}

/// X's 100 jobs are cancelled: it has nothing waiting. Its next job arrives behind a's
/// backlog and must wait for about one job per tenant, not for a's next 100.
fn a_cancelled_backlog_does_not_push_its_tenant_s_next_job_behind_others(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    backlog(&mut conn, "c", "a", 300);
    for id in backlog(&mut conn, "c", "x", 100) {
        assert!(jobs::cancel(&mut conn, id).unwrap());
    }
    claim_and_complete(&mut conn, "c", 3);
    let next_x = enqueue_id(&mut conn, fair("c", "x"));
    let next = claim_and_complete(&mut conn, "c", 3);
    assert!(
        next.iter().any(|job| job.id == next_x),
        "x's job waits behind a's backlog for its cancelled jobs' turns: {:?}",
        kinds(&next)
    );
}

/// X scheduled 100 jobs for in an hour: none is due. A job it enqueues for now must take
/// its turn among a's backlog, not wait for a hundred of a's jobs.
fn jobs_scheduled_for_later_do_not_push_their_tenant_s_due_job_behind_others(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let later: Vec<NewJob> = (0..100)
        .map(|_| fair("s", "x").delay(Duration::from_secs(3600)))
        .collect();
    jobs::enqueue_many(&mut conn, &later).unwrap();
    backlog(&mut conn, "s", "a", 200);
    claim_and_complete(&mut conn, "s", 3);
    let now_x = enqueue_id(&mut conn, fair("s", "x"));
    let next = claim_and_complete(&mut conn, "s", 3);
    assert!(
        next.iter().any(|job| job.id == now_x),
        "x's due job waits behind a's backlog for its scheduled jobs' turns: {:?}",
        kinds(&next)
    );
}

/// A has a backlog at priority 0; b has one at priority -1. A's one urgent job (priority -1)
/// arrives behind b's backlog: it must wait for about one job of b, not for all 200.
fn a_backlog_at_another_priority_does_not_push_an_urgent_job_behind_others(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    backlog(&mut conn, "p", "a", 200);
    let urgent_b: Vec<NewJob> = (0..200).map(|_| fair("p", "b").priority(-1)).collect();
    jobs::enqueue_many(&mut conn, &urgent_b).unwrap();
    let urgent_a = enqueue_id(&mut conn, fair("p", "a").priority(-1));
    let next = claim_and_complete(&mut conn, "p", 3);
    assert!(
        next.iter().any(|job| job.id == urgent_a),
        "a's urgent job waits behind b's whole urgent backlog: {:?}",
        kinds(&next)
    );
}

/// X's second job is due but its limit (1 running) holds it while x's first runs. A's
/// backlog runs on; then b arrives with 40 jobs. While both a and b have jobs waiting they
/// must take turns: b must not take every claim because x's held job keeps the virtual time
/// where it was 200 claims ago.
fn a_job_its_limit_holds_does_not_hand_a_newcomer_the_whole_queue(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    backlog(&mut conn, "l", "a", 300);
    let x1 = enqueue_id(&mut conn, fair("l", "x").limit("x-api", 1));
    let first = jobs::claim(&mut conn, "l", 3, TTL).unwrap();
    assert!(first.iter().any(|job| job.id == x1), "{:?}", kinds(&first));
    let others: Vec<_> = first
        .iter()
        .filter(|job| job.id != x1)
        .map(|job| job.claim())
        .collect();
    jobs::complete(&mut conn, &others).unwrap();
    // X's second job waits for x's first (still running) to finish.
    enqueue_id(&mut conn, fair("l", "x").limit("x-api", 1));
    for _ in 0..10 {
        let claimed = claim_and_complete(&mut conn, "l", 20);
        assert!(claimed.iter().all(|job| job.kind == "a"));
    }
    backlog(&mut conn, "l", "b", 40);
    let next = claim_and_complete(&mut conn, "l", 20);
    let of_a = next.iter().filter(|job| job.kind == "a").count();
    assert!(
        (8..=12).contains(&of_a),
        "a got {of_a} of the 20 claims after b arrived (x's held job at the virtual time): {:?}",
        kinds(&next)
    );
}

/// The ring's rotations between enqueue and claim keep every job's stamp (PostgreSQL copies
/// entries; MariaDB moves them): b's jobs still take turns with a's.
fn the_ring_s_rotation_keeps_the_turns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    backlog(&mut conn, "r", "a", 40);
    for _ in 0..2 {
        jobs::rotate_ready(&mut conn, Duration::ZERO).unwrap();
    }
    backlog(&mut conn, "r", "b", 5);
    for _ in 0..3 {
        jobs::rotate_ready(&mut conn, Duration::ZERO).unwrap();
    }
    if backend != Backend::Sqlite {
        let (ready, mismatched) = (
            count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_ready"),
            count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_ready r JOIN tenure_jobs j ON j.id = r.id \
                 WHERE r.fair_stamp <> j.fair_stamp",
            ),
        );
        assert_eq!((ready, mismatched), (45, 0));
    }
    let next = claim_and_complete(&mut conn, "r", 10);
    let of_b = next.iter().filter(|job| job.kind == "b").count();
    assert!((4..=5).contains(&of_b), "{:?}", kinds(&next));
}

/// An enqueue in a caller's transaction that rolls back, and a failed enqueue in one that
/// commits, leave the tenant's last stamp where it was: its next job has the first turn.
fn a_rolled_back_enqueue_leaves_its_tenant_s_turns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let rolled: Result<(), tenure::Error> = tenure::transaction(&mut conn, |c| {
        for _ in 0..5 {
            jobs::enqueue(c, &fair("t", "x"))?;
        }
        jobs::enqueue_many(c, &[fair("t", "x"), fair("t", "y")])?;
        Err(tenure::Error::Database(
            diesel::result::Error::RollbackTransaction,
        ))
    });
    assert!(rolled.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    let committed: Result<i64, tenure::Error> = tenure::transaction(&mut conn, |c| {
        let missing = jobs::enqueue(c, &fair("t", "x").depends_on([i64::MAX - 1]));
        assert!(missing.is_err());
        let missing = jobs::enqueue_many(c, &[fair("t", "x"), fair("t", "x").depends_on([7])]);
        assert!(missing.is_err());
        Ok(jobs::enqueue(c, &fair("t", "x"))?.id)
    });
    let id = committed.unwrap();
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT fair_stamp AS n FROM tenure_jobs WHERE id = {id}")
        ),
        1_000_000
    );
    assert_eq!(last_stamp(&mut conn, "t", "x"), 1_000_000);
}

/// A tenant whose stamps would pass i64::MAX gets a typed error (no panic, no wrap), and
/// nothing changes; another tenant enqueues as before.
fn exhausted_stamps_are_a_typed_error_and_change_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // X's waiting job has a turn near the end of the stamps (written by hand, job and ring).
    let x = enqueue_id(&mut conn, fair("o", "x"));
    let near = i64::MAX - 500_000;
    diesel::sql_query(format!(
        "UPDATE tenure_jobs SET fair_stamp = {near} WHERE id = {x}"
    ))
    .execute(&mut conn)
    .unwrap();
    if backend != Backend::Sqlite {
        diesel::sql_query(format!(
            "UPDATE tenure_ready SET fair_stamp = {near} WHERE id = {x}"
        ))
        .execute(&mut conn)
        .unwrap();
    }
    let error = jobs::enqueue(&mut conn, &fair("o", "x")).unwrap_err();
    assert!(error.is_invalid_input(), "{error}");
    let error = jobs::enqueue_many(&mut conn, &[fair("o", "y"), fair("o", "x")]).unwrap_err();
    assert!(error.is_invalid_input(), "{error}");
    // Weight 1000 moves it by 1,000 a job: 500 more jobs, then the same error.
    jobs::set_fair_weight(&mut conn, "o", "x", 1000).unwrap();
    let batch: Vec<NewJob> = (0..500).map(|_| fair("o", "x")).collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let error = jobs::enqueue(&mut conn, &fair("o", "x")).unwrap_err();
    assert!(error.is_invalid_input(), "{error}");
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        501
    );
    assert_eq!(last_stamp(&mut conn, "o", "x"), near + 500 * 1000);
    // Y was refused with x's batch: nothing of it was written.
    assert_eq!(last_stamp(&mut conn, "o", "y"), -1);
}

/// Six producers enqueue batches of the same tenants (two shared by all, three new each
/// round and shared by the round) in different orders, while two claimers claim and
/// complete: every enqueue succeeds, nothing is lost, and no two jobs of a tenant share a
/// stamp; each tenant's last stamp is its greatest.
fn concurrent_batches_of_overlapping_tenants_in_any_order(backend: Backend) {
    const PRODUCERS: usize = 6;
    const ROUNDS: usize = 15;
    let db = TestDb::migrated(backend);
    let barrier = Arc::new(Barrier::new(PRODUCERS));
    let done = Arc::new(AtomicUsize::new(0));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let mut conn = db.connect();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let mut tenants: Vec<String> = vec!["s1".into(), "s2".into()];
                    tenants.extend((0..3).map(|t| format!("r{round}t{t}")));
                    let n = tenants.len();
                    tenants.rotate_left(p % n);
                    if p % 2 == 1 {
                        tenants.reverse();
                    }
                    let batch: Vec<NewJob> = tenants
                        .iter()
                        .flat_map(|t| [fair("o", t), fair("o", t).priority(p as i32 % 2)])
                        .collect();
                    barrier.wait();
                    jobs::enqueue_many(&mut conn, &batch).unwrap();
                    enqueue_id(&mut conn, fair("o", &tenants[0]));
                }
            })
        })
        .collect();
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let mut conn = db.connect();
            let done = done.clone();
            std::thread::spawn(move || {
                while done.load(Ordering::SeqCst) == 0 {
                    if claim_and_complete(&mut conn, "o", 5).is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    done.store(1, Ordering::SeqCst);
    for claimer in claimers {
        claimer.join().unwrap();
    }
    let mut conn = db.connect();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        (PRODUCERS * ROUNDS * 11) as i64
    );
    // Every job has its turn (a job claimed meanwhile may share one with a later job of its
    // tenant: turns are unique among a tenant's waiting jobs, which
    // `one_tenant_s_concurrent_producers_never_share_a_stamp` proves without claimers).
    let unstamped = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE fair_stamp <= 0",
    );
    assert_eq!(unstamped, 0, "a fair job without a turn");
}

/// The same race inside callers' transactions (where tenure does not run a transaction
/// again): batches of overlapping tenants, new and old, in opposite orders never deadlock.
fn concurrent_batches_in_callers_transactions_never_deadlock(backend: Backend) {
    const PRODUCERS: usize = 4;
    const ROUNDS: usize = 25;
    let db = TestDb::migrated(backend);
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let barrier = Arc::new(Barrier::new(PRODUCERS));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let mut conn = db.connect();
            let (barrier, errors) = (barrier.clone(), errors.clone());
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let mut tenants: Vec<String> =
                        (0..4).map(|t| format!("n{round}-{t}")).collect();
                    tenants.extend(["old-a".to_string(), "old-b".to_string()]);
                    if p % 2 == 1 {
                        tenants.reverse();
                    }
                    let batch: Vec<NewJob> = tenants.iter().map(|t| fair("d", t)).collect();
                    barrier.wait();
                    let result: Result<_, tenure::Error> =
                        tenure::transaction(&mut conn, |c| jobs::enqueue_many(c, &batch));
                    if let Err(e) = result {
                        errors.lock().unwrap().push(e.to_string());
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.join().unwrap();
    }
    let errors = errors.lock().unwrap().clone();
    assert!(
        errors.is_empty(),
        "{} enqueues failed: {errors:?}",
        errors.len()
    );
    let mut conn = db.connect();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        (PRODUCERS * ROUNDS * 6) as i64
    );
}

/// 1,000 tenants with two jobs each (one batch: every first job has the first turn), eight
/// claimers on their own connections: every job is claimed once, and no second job is
/// claimed before the first jobs but for the claims in flight.
fn a_thousand_tenants_and_eight_claimers_take_turns(backend: Backend) {
    const TENANTS: usize = 1000;
    const CLAIMERS: usize = 8;
    const PER_CLAIM: usize = 4;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..2)
        .flat_map(|n| {
            (0..TENANTS)
                .map(move |t| NewJob::new("m", format!("n{n}"), vec![]).fair_key(format!("t{t}")))
        })
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let position = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<BTreeMap<i64, (usize, String)>>> = Arc::default();
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let (position, seen) = (position.clone(), seen.clone());
            std::thread::spawn(move || {
                loop {
                    let claimed = jobs::claim(&mut conn, "m", PER_CLAIM, TTL).unwrap();
                    if claimed.is_empty() {
                        return;
                    }
                    {
                        let mut seen = seen.lock().unwrap();
                        for job in &claimed {
                            let at = position.fetch_add(1, Ordering::SeqCst);
                            assert!(
                                seen.insert(job.id, (at, job.kind.clone())).is_none(),
                                "job {} claimed twice",
                                job.id
                            );
                        }
                    }
                    let claims: Vec<_> = claimed.iter().map(|job| job.claim()).collect();
                    jobs::complete(&mut conn, &claims).unwrap();
                }
            })
        })
        .collect();
    for claimer in claimers {
        claimer.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2 * TENANTS);
    let in_flight = CLAIMERS * PER_CLAIM;
    let early: BTreeSet<usize> = seen
        .values()
        .filter(|(at, kind)| kind == "n1" && *at + in_flight < TENANTS)
        .map(|(at, _)| *at)
        .collect();
    assert!(
        early.is_empty(),
        "second jobs claimed among the first: {early:?}"
    );
}

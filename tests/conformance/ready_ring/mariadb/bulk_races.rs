//! MariaDB's bulk enqueue (multi-row keyed upserts with RETURNING, ready entries written by
//! the bulk itself) keeps one entry per waiting job, one live job per key and exact
//! `existing`/`updated` outcomes: keyed batches racing in different orders, modes over
//! running jobs and other kinds, chunk splits in a keyed run, callers' transactions beside
//! rotations and claimers, rollbacks and bad input.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob, OnDuplicate};
use tenure::{Backend, Error};

use super::super::{NO_WAIT, TTL, assert_ring_exact, claims, spawn_rotator};

/// A claimed job's id and the payload its claimer read.
type SeenPayload = (i64, Vec<u8>);
use crate::common::{TestDb, count};

fn live_per_key(conn: &mut tenure::AnyConnection, queue: &str) -> Vec<(String, i64)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        k: String,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query(format!(
        "SELECT CAST(dedup_key AS CHAR) AS k, COUNT(*) AS n FROM tenure_jobs \
         WHERE queue = '{queue}' AND dedup_key IS NOT NULL AND state IN ('waiting','running') \
         GROUP BY dedup_key HAVING COUNT(*) > 1"
    ))
    .load::<Row>(conn)
    .unwrap()
    .into_iter()
    .map(|r| (r.k, r.n))
    .collect()
}

/// Several threads, each on its own connection, enqueue the same keys in shuffled orders
/// (multi-row upserts that lock the unique index in different orders: deadlocks). Every
/// batch must succeed (deadlocks retried), exactly one job per key be new each round, every
/// other report `existing` with that id, and the ring stay exact.
#[test]
fn mysql_bulk_keyed_batches_racing_in_different_orders() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    const THREADS: usize = 6;
    const KEYS: usize = 30;
    const ROUNDS: usize = 15;
    let deadlocks = |c: &mut tenure::AnyConnection| {
        count(
            c,
            "SELECT CAST(VARIABLE_VALUE AS SIGNED) AS n FROM information_schema.GLOBAL_STATUS \
                  WHERE VARIABLE_NAME = 'INNODB_DEADLOCKS'",
        )
    };
    let deadlocks_before = deadlocks(&mut conn);
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut broken = Vec::new();
    for round in 0..ROUNDS {
        let barrier = Arc::new(std::sync::Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let mut c = db.connect();
                let barrier = barrier.clone();
                let errors = errors.clone();
                std::thread::spawn(move || {
                    let mut keys: Vec<usize> = (0..KEYS).collect();
                    // Each thread its own order: rotated and, for odd threads, reversed.
                    keys.rotate_left((t * 7 + round) % KEYS);
                    if t % 2 == 1 {
                        keys.reverse();
                    }
                    let mode = [
                        OnDuplicate::Keep,
                        OnDuplicate::Replace,
                        OnDuplicate::KeepEarlierDue,
                    ][round % 3];
                    let batch: Vec<NewJob> = keys
                        .iter()
                        .map(|k| {
                            NewJob::new("q", "a", vec![t as u8])
                                .dedup_key(format!("r{round}k{k}"))
                                .on_duplicate(mode)
                        })
                        .collect();
                    barrier.wait();
                    match jobs::enqueue_many(&mut c, &batch) {
                        Ok(out) => Some(
                            keys.iter()
                                .zip(out)
                                .map(|(k, e)| (*k, e.id, e.existing))
                                .collect::<Vec<_>>(),
                        ),
                        Err(e) => {
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("round {round} thread {t}: {e}"));
                            None
                        }
                    }
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let mut by_key: HashMap<usize, (HashSet<i64>, usize)> = HashMap::new();
        for r in results.iter().flatten() {
            for (k, id, existing) in r {
                let e = by_key.entry(*k).or_default();
                e.0.insert(*id);
                if !existing {
                    e.1 += 1;
                }
            }
        }
        for (k, (ids, new)) in by_key {
            if ids.len() != 1 || new != 1 {
                broken.push(format!("round {round} key {k}: ids {ids:?}, {new} new"));
            }
        }
    }
    let errors = errors.lock().unwrap().clone();
    println!(
        "{} batches failed: {errors:?}; server deadlocks meanwhile (all databases): {}",
        errors.len(),
        deadlocks(&mut conn) - deadlocks_before
    );
    assert_ring_exact(&mut conn, backend, "after racing keyed batches");
    assert_eq!(
        live_per_key(&mut conn, "q"),
        vec![],
        "keys with two live jobs"
    );
    assert!(broken.is_empty(), "outcomes per key wrong: {broken:?}");
    assert!(
        errors.is_empty(),
        "racing keyed batches surfaced errors: {errors:?}"
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        (KEYS * ROUNDS) as i64
    );
}

/// A keyed Replace run over live jobs: one waiting of the same kind (replaced), one waiting
/// of another kind (unchanged), one running (unchanged), one new, plus a within-batch twin
/// that folds into the first. Compared with what single enqueues report on PostgreSQL and
/// MariaDB.
#[test]
fn mysql_bulk_replace_run_over_other_kinds_and_running_jobs() {
    for backend in [Backend::Mysql, Backend::Postgres] {
        let db = TestDb::migrated(backend);
        let mut conn = db.connect();
        let same = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![1]).dedup_key("same"))
            .unwrap()
            .id;
        let other = jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "b", vec![1]).dedup_key("other"),
        )
        .unwrap()
        .id;
        let running = jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "a", vec![1]).dedup_key("running"),
        )
        .unwrap()
        .id;
        // Claim only the "running" job: claim all, give back the others.
        let taken = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
        let back: Vec<_> = taken
            .iter()
            .filter(|j| j.id != running)
            .map(|j| j.claim())
            .collect();
        jobs::give_back(&mut conn, &back).unwrap();
        let r = |k: &str, kind: &str| {
            NewJob::new("q", kind, vec![9])
                .dedup_key(k)
                .on_duplicate(OnDuplicate::Replace)
                .delay(Duration::from_secs(300))
        };
        let batch = vec![
            r("same", "a"),
            r("other", "a"),
            r("running", "a"),
            r("new", "a"),
            r("same", "a"),
            r("new2", "a"),
        ];
        let out = jobs::enqueue_many(&mut conn, &batch).unwrap();
        let got: Vec<(bool, bool)> = out.iter().map(|e| (e.existing, e.updated)).collect();
        assert_eq!(out[0].id, same, "{backend:?}");
        assert_eq!(out[1].id, other, "{backend:?}");
        assert_eq!(out[2].id, running, "{backend:?}");
        assert_eq!(
            out[4].id, same,
            "{backend:?}: the twin folds into the first"
        );
        assert_eq!(
            got,
            vec![
                (true, true),
                (true, false),
                (true, false),
                (false, false),
                (true, true),
                (false, false)
            ],
            "{backend:?}: existing/updated per job"
        );
        let payload = |conn: &mut tenure::AnyConnection, id: i64| {
            count(
                conn,
                &format!("SELECT CAST(payload AS SIGNED) AS n FROM tenure_jobs WHERE id = {id}"),
            )
        };
        let _ = payload;
        let changed = |conn: &mut tenure::AnyConnection, id: i64| {
            count(
                conn,
                &format!(
                    "SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id} AND due_at > {}",
                    if backend == Backend::Mysql {
                        "UTC_TIMESTAMP(6) + INTERVAL 100 SECOND"
                    } else {
                        "now() + interval '100 seconds'"
                    }
                ),
            )
        };
        assert_eq!(
            changed(&mut conn, same),
            1,
            "{backend:?}: same kind replaced"
        );
        assert_eq!(
            changed(&mut conn, other),
            0,
            "{backend:?}: other kind unchanged"
        );
        assert_eq!(
            changed(&mut conn, running),
            0,
            "{backend:?}: running unchanged"
        );
        assert_ring_exact(&mut conn, backend, "after a Replace run over mixed jobs");
    }
}

/// A keyed run of big payloads (1.5 MiB each) split into several statements by
/// `INSERT_CHUNK_BYTES`, over live jobs and new ones, with fair keys and limits mixed in.
#[test]
fn mysql_bulk_keyed_run_split_by_bytes_with_fair_keys_and_limits() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for k in [1, 4, 7] {
        jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "a", vec![]).dedup_key(format!("k{k}")),
        )
        .unwrap();
    }
    let batch: Vec<NewJob> = (0..9)
        .map(|k| {
            let job = NewJob::new("q", "a", vec![k as u8; 1536 * 1024])
                .dedup_key(format!("k{k}"))
                .on_duplicate(OnDuplicate::Replace)
                .fair_key(["t1", "t2"][k % 2]);
            if k % 3 == 0 { job.limit("lim", 2) } else { job }
        })
        .collect();
    let out = jobs::enqueue_many(&mut conn, &batch).unwrap();
    let existing: Vec<bool> = out.iter().map(|e| e.existing).collect();
    assert_eq!(
        existing,
        (0..9).map(|k| k % 3 == 1).collect::<Vec<_>>(),
        "existing per job"
    );
    assert!(out.iter().all(|e| e.existing == e.updated), "{out:?}");
    assert_ring_exact(&mut conn, backend, "after a keyed run split by bytes");
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 9);
}

/// A caller's REPEATABLE READ transaction runs a bulk (plain and keyed runs) and stays open:
/// a rotation beside it must not wait for the caller (its entries' statement reads the ring's
/// generation as the trigger does, without a lock). And bulk callers in their transactions
/// racing a fast rotator and claimers: every job claimed once, the ring exact.
#[test]
fn mysql_bulk_an_open_callers_bulk_does_not_hold_rotations() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut caller = db.connect();
    caller
        .batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    let rotator = db.connect();
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let mut rotator = rotator;
        // Wait for the caller's bulk, then rotate.
        let _: () = rx.recv().unwrap();
        let started = Instant::now();
        let r = jobs::rotate_ready(&mut rotator, NO_WAIT);
        (started.elapsed(), r.map(|x| x.is_some()))
    });
    let held = Duration::from_secs(3);
    caller
        .transaction::<_, Error, _>(|c| {
            count(c, "SELECT COUNT(*) AS n FROM tenure_leases");
            let batch: Vec<NewJob> = (0..20)
                .map(|i| {
                    let j = NewJob::new("q", "a", vec![]);
                    if i >= 10 {
                        j.dedup_key(format!("k{i}"))
                    } else {
                        j
                    }
                })
                .collect();
            jobs::enqueue_many(c, &batch)?;
            tx.send(()).unwrap();
            std::thread::sleep(held);
            Ok(())
        })
        .unwrap();
    let (took, rotated) = handle.join().unwrap();
    println!("rotation beside an open bulk caller took {took:?}: {rotated:?}");
    let mut conn = db.connect();
    assert_ring_exact(&mut conn, backend, "after the caller committed");
    assert!(
        took < Duration::from_millis(2_500),
        "a rotation waited {took:?} for a caller's open transaction after enqueue_many \
         (rotated: {rotated:?})"
    );
}

/// Bulk callers in REPEATABLE READ transactions (read view started before rotations) racing
/// a fast rotator and claimers: every committed job claimed exactly once, the ring exact.
#[test]
fn mysql_bulk_repeatable_read_bulks_racing_rotations_and_claims() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let stop = Arc::new(AtomicBool::new(false));
    let (rotator, rotations) = spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(1));
    let claimed: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let mut c = db.connect();
            let stop = stop.clone();
            let claimed = claimed.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let batch = jobs::claim(&mut c, "q", 50, TTL).unwrap();
                    for j in &batch {
                        *claimed.lock().unwrap().entry(j.id).or_default() += 1;
                    }
                    if !batch.is_empty() {
                        jobs::complete(&mut c, &claims(&batch)).unwrap();
                    }
                }
            })
        })
        .collect();
    let committed: Arc<Mutex<HashSet<i64>>> = Arc::default();
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let callers: Vec<_> = (0..3)
        .map(|t| {
            let mut c = db.connect();
            c.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .unwrap();
            let committed = committed.clone();
            let failures = failures.clone();
            std::thread::spawn(move || {
                for round in 0..25 {
                    let r = c.transaction::<_, Error, _>(|c| {
                        count(c, "SELECT COUNT(*) AS n FROM tenure_leases");
                        std::thread::sleep(Duration::from_millis(5));
                        let batch: Vec<NewJob> = (0..30)
                            .map(|i| {
                                let j = NewJob::new("q", "a", vec![]).fair_key(["f1", "f2"][i % 2]);
                                if i % 3 == 0 {
                                    j.dedup_key(format!("t{t}r{round}k{i}"))
                                        .on_duplicate(OnDuplicate::Replace)
                                } else if i % 5 == 0 {
                                    j.limit("L", 5)
                                } else {
                                    j
                                }
                            })
                            .collect();
                        jobs::enqueue_many(c, &batch)
                    });
                    match r {
                        Ok(out) => committed.lock().unwrap().extend(out.iter().map(|e| e.id)),
                        Err(e) if e.is_retryable() => {}
                        Err(e) => failures.lock().unwrap().push(e.to_string()),
                    }
                }
            })
        })
        .collect();
    for c in callers {
        c.join().unwrap();
    }
    // Let the claimers take what is due (limits may hold some back).
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    rotator.join().unwrap();
    for c in claimers {
        c.join().unwrap();
    }
    let mut conn = db.connect();
    assert_ring_exact(&mut conn, backend, "after RR bulks racing rotations");
    // Drain the rest.
    loop {
        let batch = jobs::claim(&mut conn, "q", 100, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        for j in &batch {
            *claimed.lock().unwrap().entry(j.id).or_default() += 1;
        }
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
    }
    let claimed = claimed.lock().unwrap().clone();
    let committed = committed.lock().unwrap().clone();
    println!(
        "{} rotations, {} jobs committed, {} claimed",
        rotations.load(Ordering::SeqCst),
        committed.len(),
        claimed.len()
    );
    let failures = failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "non-retryable failures: {failures:?}");
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "claimed more than once: {twice:?}");
    let lost: Vec<_> = committed
        .iter()
        .filter(|id| !claimed.contains_key(id))
        .collect();
    let waiting = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'",
    );
    assert!(
        lost.is_empty(),
        "{} committed jobs never claimed ({waiting} still waiting)",
        lost.len()
    );
}

/// A keyed Replace batch racing claimers that take the jobs it folds into: a batch that
/// reports `updated` must have changed a waiting job, so a claimer never holds a job whose
/// payload a later-reported `updated` changed after the claim; no key ever has two live jobs.
#[test]
fn mysql_bulk_keyed_batch_folding_into_jobs_being_claimed() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let stop = Arc::new(AtomicBool::new(false));
    const KEYS: usize = 20;
    // id -> payload the claimer saw; the claimer never completes (jobs stay running).
    let seen: Arc<Mutex<Vec<SeenPayload>>> = Arc::default();
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let mut c = db.connect();
            let stop = stop.clone();
            let seen = seen.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let batch = jobs::claim(&mut c, "q", 3, TTL).unwrap();
                    seen.lock()
                        .unwrap()
                        .extend(batch.iter().map(|j| (j.id, j.payload.clone())));
                    if !batch.is_empty() {
                        jobs::complete(&mut c, &claims(&batch)).unwrap();
                    }
                }
            })
        })
        .collect();
    let mut conn = db.connect();
    let mut errors = Vec::new();
    let mut updated_reports: Vec<(i64, u8)> = Vec::new();
    for round in 0..200u32 {
        let batch: Vec<NewJob> = (0..KEYS)
            .map(|k| {
                NewJob::new("q", "a", vec![(round % 250) as u8])
                    .dedup_key(format!("k{k}"))
                    .on_duplicate(OnDuplicate::Replace)
            })
            .collect();
        match jobs::enqueue_many(&mut conn, &batch) {
            Ok(out) => {
                for e in out.iter().filter(|e| e.updated) {
                    updated_reports.push((e.id, (round % 250) as u8));
                }
            }
            Err(e) => errors.push(e.to_string()),
        }
        let dup = live_per_key(&mut conn, "q");
        assert!(
            dup.is_empty(),
            "round {round}: keys with two live jobs {dup:?}"
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    for c in claimers {
        c.join().unwrap();
    }
    let _ = jobs::claim(&mut conn, "q", 1000, TTL);
    // Every job's last update report must match what a claimer saw, if it was claimed.
    let seen: HashMap<i64, Vec<u8>> = seen.lock().unwrap().iter().cloned().collect();
    let mut last: HashMap<i64, u8> = HashMap::new();
    for (id, p) in &updated_reports {
        last.insert(*id, *p);
    }
    let mismatched: Vec<_> = last
        .iter()
        .filter(|(id, p)| seen.get(id).is_some_and(|s| s != &vec![**p]))
        .collect();
    assert!(errors.is_empty(), "batches failed: {errors:?}");
    assert!(
        mismatched.is_empty(),
        "jobs reported updated after their claim read another payload: {mismatched:?}"
    );
    assert_ring_exact(&mut conn, backend, "after batches racing claimers");
}

/// A rolled-back caller's bulk (plain and keyed runs, big ones) leaves no job and no entry;
/// an invalid job anywhere in a keyed batch is a typed error and writes nothing.
#[test]
fn mysql_bulk_rollback_and_bad_input_leave_nothing() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let r = conn.transaction::<(), Error, _>(|c| {
        let batch: Vec<NewJob> = (0..1500)
            .map(|i| {
                let j = NewJob::new("q", "a", vec![]);
                if i >= 700 {
                    j.dedup_key(format!("k{i}"))
                } else {
                    j
                }
            })
            .collect();
        jobs::enqueue_many(c, &batch)?;
        Err(Error::from(diesel::result::Error::RollbackTransaction))
    });
    assert!(r.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_ready"),
        0
    );
    let mut batch: Vec<NewJob> = (0..10)
        .map(|i| NewJob::new("q", "a", vec![]).dedup_key(format!("k{i}")))
        .collect();
    batch.push(NewJob::new("q", "a", vec![]).dedup_key("x".repeat(300)));
    let r = jobs::enqueue_many(&mut conn, &batch);
    assert!(
        matches!(r, Err(Error::InvalidInput { .. })),
        "a 300-byte key: {r:?}"
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_ring_exact(&mut conn, backend, "after rollback and bad input");
}

//! Callers' own transactions across rotations of the ready ring: a REPEATABLE READ cancel or
//! replacing duplicate whose snapshot predates a rotation fails retryably rather than leave
//! an entry behind; a rotation never runs under an old snapshot; a READ COMMITTED caller's
//! open transaction neither blocks rotations nor loses anything; replacing duplicates racing
//! rotations and claims never run a job early.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob, OnDuplicate};
use tenure::{AnyConnection, Backend, Error};

use super::{
    NO_WAIT, TTL, assert_not_early, assert_ring_exact, claims, rotate_times, spawn_rotator,
};
use crate::common::{TestDb, conformance};

conformance!(
    a_repeatable_read_cancel_after_rotations_leaves_no_entry,
    a_repeatable_read_replace_after_rotations_leaves_one_entry,
    a_callers_open_transaction_across_rotations_loses_nothing,
    replacing_duplicates_racing_rotations_and_claims_never_run_a_job_early,
);

/// A caller's transaction at REPEATABLE READ on `caller` (MySQL's default isolation; a
/// choice on PostgreSQL) reads first (its snapshot starts there), then rotations on `conn`
/// move every entry of the ring (three of them: each slot emptied once), then `change` runs
/// in the caller's transaction. The entries the rotations wrote are newer than the caller's
/// snapshot, and the slots they left were truncated: a statement under that snapshot sees
/// no entry for a waiting job. Returns the change's outcome (the transaction committed if
/// it is `Ok`).
fn after_rotations_in_repeatable_read<T>(
    backend: Backend,
    conn: &mut AnyConnection,
    caller: &mut AnyConnection,
    id: i64,
    change: impl FnOnce(&mut AnyConnection) -> tenure::Result<T>,
) -> tenure::Result<T> {
    match backend {
        Backend::Postgres => caller.batch_execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        ),
        Backend::Mysql => {
            caller.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        }
        Backend::Sqlite => Ok(()),
    }
    .unwrap();
    caller.transaction::<_, Error, _>(|c| {
        assert_eq!(jobs::get(c, id)?.unwrap().state, jobs::JobState::Waiting);
        let rotated = rotate_times(conn, 3);
        if backend != Backend::Sqlite {
            assert_eq!(rotated, 3, "rotations under the caller's snapshot");
        }
        change(c)
    })
}

/// A cancel in a caller's REPEATABLE READ transaction, after rotations moved the waiting
/// job's entry past the caller's snapshot: either it fails with a serialization error
/// (nothing changed, the job still waits and is claimable) or the cancelled job has no entry
/// left and no claim ever takes it. (Before: the trigger's delete, under the caller's
/// snapshot, found no entry and deleted nothing; the cancel committed and the next claim
/// took the cancelled job and ran it.)
fn a_repeatable_read_cancel_after_rotations_leaves_no_entry(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let doomed = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let outcome =
        after_rotations_in_repeatable_read(backend, &mut conn, &mut caller, doomed, |c| {
            jobs::cancel(c, doomed)
        });
    let state = jobs::get(&mut conn, doomed).unwrap().unwrap().state;
    match outcome {
        Ok(cancelled) => {
            assert!(cancelled, "{backend}: the waiting job was not cancelled");
            assert_eq!(state, jobs::JobState::Cancelled);
        }
        Err(e) => {
            assert!(
                e.is_retryable(),
                "{backend}: not a serialization error: {e}"
            );
            assert_eq!(state, jobs::JobState::Waiting);
        }
    }
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    if state == jobs::JobState::Cancelled {
        assert!(
            taken.is_empty(),
            "{backend}: a cancelled job was claimed: {taken:?}"
        );
    } else {
        assert_eq!(taken, vec![doomed], "{backend}: the job still waiting");
    }
    assert_ring_exact(&mut conn, backend, "after a cancel at REPEATABLE READ");
}

/// A replacing duplicate (a later due time) in a caller's REPEATABLE READ transaction, after
/// rotations moved the waiting job's entry past the caller's snapshot: either it fails with
/// a serialization error (the job unchanged) or the job keeps one entry, with its new due
/// time, and no claim takes it before then. (Before: the old entry stayed beside the new
/// one, and a claim took the job at once, ten minutes early.)
fn a_repeatable_read_replace_after_rotations_leaves_one_entry(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let job = NewJob::new("q", "a", vec![]).dedup_key("d");
    let id = jobs::enqueue(&mut conn, &job).unwrap().id;
    let later = job
        .clone()
        .delay(Duration::from_secs(600))
        .on_duplicate(OnDuplicate::Replace);
    let outcome = after_rotations_in_repeatable_read(backend, &mut conn, &mut caller, id, |c| {
        jobs::enqueue(c, &later)
    });
    let replaced = match outcome {
        Ok(enqueued) => {
            assert_eq!(enqueued.id, id);
            assert!(
                enqueued.updated,
                "{backend}: the waiting job was not replaced"
            );
            true
        }
        Err(e) => {
            assert!(
                e.is_retryable(),
                "{backend}: not a serialization error: {e}"
            );
            false
        }
    };
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    if replaced {
        assert!(
            taken.is_empty(),
            "{backend}: the job due in ten minutes was claimed now: {taken:?}"
        );
    } else {
        assert_eq!(taken, vec![id], "{backend}: the job unchanged, due now");
    }
    assert_ring_exact(&mut conn, backend, "after a replace at REPEATABLE READ");
}

/// PostgreSQL: the rotation's function called in a REPEATABLE READ transaction (by hand:
/// [`jobs::rotate_ready`] begins READ COMMITTED) whose snapshot began before an enqueue
/// into the oldest slot committed: the rotation must not truncate the entry it cannot see.
/// The enqueue's transaction stays open across two rotations (they leave its slot alone),
/// the rotating transaction's snapshot begins, the enqueue commits, then the third rotation
/// would empty that slot. (Before: its copy, under the old snapshot, missed the new entry
/// and the truncate removed it: a waiting job no claim could ever find.)
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_rotation_under_an_old_snapshot_loses_no_entry() {
    let backend = Backend::Postgres;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut rotator = db.connect();
    let mut writer = db.connect();
    let id = writer
        .transaction::<_, Error, _>(|w| {
            let id = jobs::enqueue(w, &NewJob::new("q", "a", vec![]))?.id;
            let rotated = rotate_times(&mut conn, 2);
            assert_eq!(rotated, 2, "rotations beside the open enqueue");
            rotator
                .batch_execute(
                    "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT COUNT(*) FROM tenure_leases",
                )
                .unwrap();
            Ok(id)
        })
        .unwrap();
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let outcome =
        diesel::sql_query("SELECT tenure_rotate_ready(0) AS n").get_result::<N>(&mut rotator);
    match &outcome {
        Ok(N { n }) => println!("the rotation under the old snapshot moved {n}"),
        Err(e) => println!("the rotation under the old snapshot refused: {e}"),
    }
    rotator
        .batch_execute(if outcome.is_ok() {
            "COMMIT"
        } else {
            "ROLLBACK"
        })
        .unwrap();
    assert_ring_exact(&mut conn, backend, "after a rotation under an old snapshot");
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(taken, vec![id], "the waiting job, claimable");
}

/// A caller's READ COMMITTED transaction enqueues (a plain job and a limited one), cancels a
/// waiting job and replaces another's due time, and stays open while rotations are tried on
/// another connection (on PostgreSQL, after the enqueues, the two that leave the slot of its
/// entries alone run, and the one that would empty it gives up, not waits; after the cancel
/// none runs: its delete holds every slot) and, on PostgreSQL, a claim runs (it must neither wait for the
/// caller nor take the jobs it holds). After the commit, more rotations: the ring is exact,
/// and a drain claims exactly the waiting jobs, once each. (It fails if a rotation or a
/// claim waited for the caller: the test hangs and is stopped; if a rotation truncated an
/// uncommitted entry, or a claim took the cancelled or the replaced job.)
fn a_callers_open_transaction_across_rotations_loses_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let enqueue = |conn: &mut AnyConnection, job: NewJob| jobs::enqueue(conn, &job).unwrap().id;
    let doomed = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let keyed = NewJob::new("q", "a", vec![]).dedup_key("d");
    let replaced = enqueue(&mut conn, keyed.clone());
    let free = enqueue(&mut conn, NewJob::new("q", "b", vec![]).priority(-1));
    let (plain, limited) = caller
        .transaction::<_, Error, _>(|c| {
            let plain = jobs::enqueue(c, &NewJob::new("q", "a", vec![]))?.id;
            let limited = jobs::enqueue(c, &NewJob::new("q", "b", vec![]).limit("k", 1))?.id;
            // Its new entries hold one slot: the two rotations that leave it alone run, the
            // third, which would empty it, gives up.
            let mut rotated = 0;
            for _ in 0..12 {
                if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
                    rotated += 1;
                }
            }
            // MariaDB's rotation needs the whole ring to itself (a table lock): none runs
            // while a transaction that wrote entries is open.
            match backend {
                Backend::Postgres => assert_eq!(rotated, 2, "rotations beside the open enqueues"),
                Backend::Mysql => assert_eq!(rotated, 0, "rotations beside the open enqueues"),
                Backend::Sqlite => {}
            }
            assert!(jobs::cancel(c, doomed)?);
            let later = keyed
                .clone()
                .delay(Duration::from_secs(600))
                .on_duplicate(OnDuplicate::Replace);
            assert!(jobs::enqueue(c, &later)?.updated);
            // Its deletes of entries hold every slot: no rotation now, none waits.
            for _ in 0..6 {
                assert_eq!(jobs::rotate_ready(&mut conn, NO_WAIT).unwrap(), None);
            }
            if backend != Backend::Sqlite {
                let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
                    .unwrap()
                    .iter()
                    .map(|j| j.id)
                    .collect();
                assert_eq!(taken, vec![free], "only the job the caller does not hold");
            }
            Ok((plain, limited))
        })
        .unwrap();
    for _ in 0..6 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    assert_ring_exact(&mut conn, backend, "after the caller committed");
    let mut taken = Vec::new();
    loop {
        let batch = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        taken.extend(batch.iter().map(|j| j.id));
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    taken.sort_unstable();
    let mut expected = vec![plain, limited];
    if backend == Backend::Sqlite {
        expected.push(free);
    }
    expected.sort_unstable();
    assert_eq!(
        taken, expected,
        "{backend}: the jobs due now, once each (not the cancelled {doomed}, not the replaced {replaced})"
    );
    assert_ring_exact(&mut conn, backend, "after the drain");
    assert_eq!(
        jobs::get(&mut conn, replaced).unwrap().unwrap().state,
        jobs::JobState::Waiting
    );
}

/// Replacing duplicates (OnDuplicate::Replace and KeepEarlierDue, each moving a waiting job's
/// due time to now or ten minutes on) race a rotator and two claimers on 20 keys: no job is
/// ever claimed before the due time it has when claimed (an entry left with an old due time
/// would be), none twice at once, and the ring ends exact.
fn replacing_duplicates_racing_rotations_and_claims_never_run_a_job_early(backend: Backend) {
    let db = TestDb::migrated(backend);
    let stop = Arc::new(AtomicBool::new(false));
    let (rotator, _) = spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(2));
    let replacer = {
        let mut conn = db.connect();
        std::thread::spawn(move || {
            for i in 0..400u32 {
                let delay = if i % 3 == 0 {
                    Duration::ZERO
                } else {
                    Duration::from_secs(600)
                };
                let mode = if i % 5 == 0 {
                    OnDuplicate::KeepEarlierDue
                } else {
                    OnDuplicate::Replace
                };
                let job = NewJob::new("rd", "a", vec![])
                    .dedup_key(format!("k{}", i % 20))
                    .delay(delay)
                    .on_duplicate(mode);
                jobs::enqueue(&mut conn, &job).expect("enqueue must not fail");
            }
        })
    };
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let (mut conn, stop) = (db.connect(), stop.clone());
            std::thread::spawn(move || {
                let mut taken = 0;
                while !stop.load(Ordering::SeqCst) {
                    let batch = jobs::claim(&mut conn, "rd", 5, TTL).expect("claim must not fail");
                    for job in &batch {
                        assert_not_early(job);
                    }
                    taken += batch.len();
                    if !batch.is_empty() {
                        jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                taken
            })
        })
        .collect();
    replacer.join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::SeqCst);
    let taken: usize = claimers.into_iter().map(|c| c.join().unwrap()).sum();
    rotator.join().unwrap();
    let mut conn = db.connect();
    println!("{backend}: {taken} jobs claimed");
    assert_ring_exact(&mut conn, backend, "after the replacing duplicates");
}

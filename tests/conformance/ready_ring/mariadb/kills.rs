//! A rotation stopped at any point (its connection killed between statements or at any
//! moment, a statement failing under its lock, a query interrupted): the ring stays exact,
//! no table stays locked, and the next rotation runs.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob};
use tenure::{Backend, Error};

use super::super::drain;
use super::super::{NO_WAIT, TTL, assert_ring_exact, claims};
use super::{slots, timed_claim};
use crate::common::{TestDb, count};

/// A rotation's connection killed after each of its steps (the entries moved; the slot
/// truncated, the generation not yet moved on): the kill ends its table lock, the ring is
/// exact, the next rotations run, and every job is claimed once.
#[test]
fn mysql_a_rotation_killed_half_way_loses_nothing() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for steps in 1..=2 {
        let (current, oldest) = slots(&mut conn);
        // A waiting job's entry in the slot the rotation empties (as an enqueue under an old
        // read view leaves it), and one in the current slot.
        for _ in 0..2 {
            ids.push(
                jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
                    .unwrap()
                    .id,
            );
        }
        let moved = ids[ids.len() - 1];
        conn.batch_execute(&format!(
            "UPDATE tenure_ready SET slot = {oldest} WHERE id = {moved}"
        ))
        .unwrap();
        let mut doomed = db.connect();
        let session = count(&mut doomed, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n");
        let mut rotation = vec![
            "LOCK TABLES tenure_ready WRITE, tenure_ready_ring WRITE NOWAIT".to_string(),
            format!("UPDATE tenure_ready SET slot = {current} WHERE slot = {oldest}"),
        ];
        if steps == 2 {
            rotation.push(format!(
                "ALTER TABLE tenure_ready TRUNCATE PARTITION p{oldest}"
            ));
        }
        for statement in &rotation {
            doomed.batch_execute(statement).unwrap();
        }
        conn.batch_execute(&format!("KILL {session}")).unwrap();
        drop(doomed);
        assert_ring_exact(
            &mut conn,
            backend,
            &format!("after a rotation killed after {steps} steps"),
        );
        for round in 0..4 {
            // The kill's end of the lock may take a moment to reach the server's tables.
            let mut tries = 0;
            while jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_none() && tries < 100 {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            assert!(
                tries < 100,
                "no rotation ran after the kill ({steps} steps, round {round})"
            );
            assert_ring_exact(&mut conn, backend, &format!("after rotation {round}"));
        }
    }
    ids.sort_unstable();
    assert_eq!(drain(&mut conn), ids, "each job once");
}

/// The generation near `BIGINT`'s end: a rotation that cannot move it on (out of range) is
/// an error, after its truncate; its `UNLOCK TABLES` still runs, so the same connection
/// (a pooled one) claims and enqueues afterwards, and the ring stays exact.
#[test]
fn mysql_a_rotation_failing_under_its_lock_is_an_error_and_unlocks() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute(&format!(
        "UPDATE tenure_ready_ring SET generation = {}",
        i64::MAX - 1
    ))
    .unwrap();
    let first = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    assert!(jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some());
    for round in 0..3 {
        let failed = jobs::rotate_ready(&mut conn, NO_WAIT);
        println!("a rotation at the generation's end: {failed:?}");
        assert!(
            matches!(failed, Err(Error::Database(_))),
            "round {round}: {failed:?}"
        );
        // The connection is not left under LOCK TABLES: other tables are usable.
        assert_ring_exact(
            &mut conn,
            backend,
            &format!("after failed rotation {round}"),
        );
    }
    let second = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    assert_eq!(drain(&mut conn), vec![first, second], "each job once");
}

/// Promise 3 with real threads: a rotator rotates as fast as it can while a killer, on its
/// own connection, `KILL`s its session at varying moments (the rotator connects again, as
/// a process restarted after a SIGKILL would); an enqueuer and a claimer run meanwhile (a
/// tenth of the jobs due in ten minutes, moved at every rotation). At the end the ring is
/// exact after more rotations, and every job due now is claimed exactly once, none early.
/// (`KILL QUERY`, which leaves the session, is
/// [`mysql_a_rotation_interrupted_by_kill_query_leaves_no_table_locked`].)
#[test]
fn mysql_rotations_killed_at_any_moment_lose_nothing() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let backend = Backend::Mysql;
    let db = Arc::new(TestDb::migrated(backend));
    let stop = Arc::new(AtomicBool::new(false));
    let session = Arc::new(AtomicI64::new(0));
    let outcomes: Arc<Mutex<HashMap<&'static str, usize>>> = Arc::default();
    // The rotation calls of the rotator's current session.
    let calls = Arc::new(AtomicUsize::new(0));
    let rotator = {
        let (db, stop, session, outcomes, calls) = (
            db.clone(),
            stop.clone(),
            session.clone(),
            outcomes.clone(),
            calls.clone(),
        );
        std::thread::spawn(move || {
            let mut conn = db.connect();
            session.store(
                count(&mut conn, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n"),
                Ordering::SeqCst,
            );
            while !stop.load(Ordering::SeqCst) {
                let rotated = jobs::rotate_ready(&mut conn, NO_WAIT);
                let outcome = match &rotated {
                    Ok(Some(_)) => "rotated",
                    Ok(None) => "none",
                    Err(_) => "error",
                };
                *outcomes.lock().unwrap().entry(outcome).or_default() += 1;
                calls.fetch_add(1, Ordering::SeqCst);
                // A breath between rotations (each a table lock and DDL): back to back, they
                // starved the enqueuer and the claimer on a loaded server.
                std::thread::sleep(Duration::from_millis(2));
                // Usable and unlocked, or gone (killed).
                let mut lost = false;
                for _ in 0..5 {
                    match diesel::sql_query("SELECT COUNT(*) FROM tenure_leases").execute(&mut conn)
                    {
                        Ok(_) => break,
                        Err(e) if e.to_string().contains("interrupted") => continue,
                        Err(e) if e.to_string().contains("LOCK TABLES") => {
                            panic!(
                                "the rotator's connection was left locked: {e} \
                                 (after the rotation's {rotated:?})"
                            )
                        }
                        Err(_) => {
                            lost = true;
                            break;
                        }
                    }
                }
                if lost {
                    *outcomes.lock().unwrap().entry("reconnected").or_default() += 1;
                    conn = db.connect();
                    calls.store(0, Ordering::SeqCst);
                    session.store(
                        count(&mut conn, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n"),
                        Ordering::SeqCst,
                    );
                }
            }
        })
    };
    let killer = {
        let (mut conn, stop, session, calls) =
            (db.connect(), stop.clone(), session.clone(), calls.clone());
        std::thread::spawn(move || {
            let (mut kills, mut killed) = (0usize, 0i64);
            let mut step = 1u64;
            while !stop.load(Ordering::SeqCst) {
                step = step
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Each session of the rotator once, after its second rotation call, at a
                // varying moment of one of the next.
                let target = session.load(Ordering::SeqCst);
                if target == killed || calls.load(Ordering::SeqCst) < 2 {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                std::thread::sleep(Duration::from_micros(step >> 51));
                if let Err(error) = conn.batch_execute(&format!("KILL {target}")) {
                    // The rotator ends (and its session with it) once the claimer is done:
                    // a kill aimed just before then finds no session. Any other time, the
                    // rotator's session must be there.
                    assert!(
                        stop.load(Ordering::SeqCst),
                        "KILL {target} failed while the rotator runs: {error}"
                    );
                    break;
                }
                killed = target;
                kills += 1;
            }
            kills
        })
    };
    let claimed: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let enqueued_all = Arc::new(AtomicBool::new(false));
    let claimer = {
        let (mut conn, claimed, enqueued_all) =
            (db.connect(), claimed.clone(), enqueued_all.clone());
        std::thread::spawn(move || {
            let mut empty = 0;
            while empty < 20 {
                let batch = jobs::claim(&mut conn, "k", 10, TTL).expect("claim must not fail");
                if batch.is_empty() {
                    if enqueued_all.load(Ordering::SeqCst) {
                        empty += 1;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                for job in &batch {
                    *claimed.lock().unwrap().entry(job.id).or_default() += 1;
                }
                jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
            }
        })
    };
    let mut conn = db.connect();
    let (mut due, mut later) = (Vec::new(), Vec::new());
    let started = Instant::now();
    for i in 0..600 {
        let mut job = NewJob::new("k", "a", vec![]);
        if i % 10 == 0 {
            job = job.delay(Duration::from_secs(600));
        }
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        if i % 10 == 0 {
            later.push(id);
        } else {
            due.push(id);
        }
        if i % 50 == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    enqueued_all.store(true, Ordering::SeqCst);
    claimer.join().unwrap();
    stop.store(true, Ordering::SeqCst);
    rotator.join().unwrap();
    let kills = killer.join().unwrap();
    let outcomes = outcomes.lock().unwrap().clone();
    println!(
        "{kills} kills in {:?}; rotation calls: {outcomes:?}",
        started.elapsed()
    );
    assert!(
        outcomes.get("rotated").copied().unwrap_or(0) >= 10,
        "too few rotations ran: {outcomes:?}"
    );
    assert!(
        outcomes.get("error").copied().unwrap_or(0) >= 10,
        "too few rotations were killed: {outcomes:?}"
    );
    let mut after = 0;
    for _ in 0..200 {
        if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
            after += 1;
            assert_ring_exact(&mut conn, backend, &format!("after rotation {after}"));
            if after == 4 {
                break;
            }
        }
    }
    assert_eq!(after, 4, "rotations after the kills");
    let claimed = claimed.lock().unwrap();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "claimed twice: {twice:?}");
    let missing: Vec<_> = due.iter().filter(|id| !claimed.contains_key(id)).collect();
    assert!(missing.is_empty(), "due jobs never claimed: {missing:?}");
    let early: Vec<_> = later.iter().filter(|id| claimed.contains_key(id)).collect();
    assert!(
        early.is_empty(),
        "jobs due in ten minutes claimed: {early:?}"
    );
}

/// A rotation interrupted by `KILL QUERY` (an operator's, a proxy's, a statement timeout's)
/// returns an error ("Query execution was interrupted") but can leave its connection under
/// `LOCK TABLES tenure_ready WRITE, tenure_ready_ring WRITE`: a kill that lands on its
/// `UNLOCK TABLES` fails that statement and the tables stay locked (the rotation tries it
/// once; a kill that lands on `LOCK TABLES` leaves nothing locked). A worker then hands the
/// connection back to its pool (it drops its connection after an error; r2d2 keeps it), and
/// every claim and enqueue on every other connection waits for the ring's lock
/// (`lock_wait_timeout`: a day by default). Rotations run in a loop on one connection while
/// another sends it `KILL QUERY` at varying moments; after each failed rotation the
/// connection must hold no table lock.
#[test]
fn mysql_a_rotation_interrupted_by_kill_query_leaves_no_table_locked() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // A few waiting entries, moved at each rotation.
    for _ in 0..20 {
        jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "a", vec![]).delay(std::time::Duration::from_secs(600)),
        )
        .unwrap();
    }
    let mut rotator = db.connect();
    let target = count(&mut rotator, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n");
    let stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let (mut conn, stop) = (db.connect(), stop.clone());
        std::thread::spawn(move || {
            let mut step = 7u64;
            while !stop.load(Ordering::SeqCst) {
                step = step
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                std::thread::sleep(Duration::from_micros(step >> 55));
                conn.batch_execute(&format!("KILL QUERY {target}")).unwrap();
            }
        })
    };
    let give_up = Instant::now() + Duration::from_secs(10);
    let (mut calls, mut interrupted, mut left_locked) = (0, 0, None);
    while Instant::now() < give_up && left_locked.is_none() {
        calls += 1;
        let rotated = jobs::rotate_ready(&mut rotator, NO_WAIT);
        if rotated.is_ok() {
            continue;
        }
        interrupted += 1;
        // A read of another table (tried again when the kill lands on it).
        for _ in 0..20 {
            match diesel::sql_query("SELECT COUNT(*) FROM tenure_leases").execute(&mut rotator) {
                Err(e) if e.to_string().contains("interrupted") => continue,
                Err(e) if e.to_string().contains("LOCK TABLES") => {
                    left_locked = Some(format!("{rotated:?}, then: {e}"));
                    break;
                }
                other => {
                    other.unwrap();
                    break;
                }
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    killer.join().unwrap();
    println!("{calls} rotations, {interrupted} interrupted; left locked: {left_locked:?}");
    let Some(left_locked) = left_locked else {
        return;
    };
    // What the rest of the database sees meanwhile: a claim on another connection.
    let (receiver, claimer) = timed_claim(&db);
    let waited = receiver.recv_timeout(Duration::from_secs(3));
    // Let the claim go (the lock ends with the session) before the test ends.
    drop(rotator);
    let taken = claimer.join().unwrap();
    panic!(
        "a rotation interrupted by KILL QUERY left its connection under LOCK TABLES \
         ({left_locked}); a claim on another connection meanwhile: {} ({taken:?})",
        match waited {
            Ok(took) => format!("took {took:?}"),
            Err(_) => "still waiting after 3 s".to_string(),
        }
    );
}

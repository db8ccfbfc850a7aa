//! MariaDB's ring (`migrations/mysql/tenure-0045_ready_ring`): its triggers read the
//! generation without a lock, so a transaction with an old read view puts its entry in an
//! older slot, and its rotation runs step by step under a table lock, each step committed on
//! its own. Neither may lose an entry: the rotation moves whatever is still in the slot it
//! empties, and one killed half-way leaves the ring exact for the next.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob};
use tenure::{AnyConnection, Backend, Error};

use super::{NO_WAIT, TTL, assert_ring_exact, claims};
use crate::common::{TestDb, count};

/// The slot new entries go to, and the one the next rotation empties.
fn slots(conn: &mut AnyConnection) -> (i64, i64) {
    let generation = count(conn, "SELECT generation AS n FROM tenure_ready_ring");
    (generation % 3, (generation + 1) % 3)
}

/// Claims every job of queue `q` due now, completing each; returns their ids in order.
fn drain(conn: &mut AnyConnection) -> Vec<i64> {
    let mut taken = Vec::new();
    loop {
        let batch = jobs::claim(conn, "q", 10, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        taken.extend(batch.iter().map(|j| j.id));
        jobs::complete(conn, &claims(&batch)).unwrap();
    }
    taken.sort_unstable();
    taken
}

/// A caller's REPEATABLE READ transaction reads (its read view starts), two rotations run
/// on another connection, then it enqueues: its trigger reads the generation of its read
/// view, two behind, so the entry goes to the slot the next rotation empties. That rotation
/// moves it (it commits before, and the rotation's lock waits for no one: the caller has
/// ended), and the job is claimed once. (A rotation that truncated the slot without moving
/// what it holds would lose the job for good.)
#[test]
fn mysql_an_entry_written_under_an_old_read_view_survives_the_rotations() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    caller
        .batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    let id = caller
        .transaction::<_, Error, _>(|c| {
            // The read view starts at the first read (of another table: one of the ring's
            // would hold its metadata lock, and no rotation could run).
            count(c, "SELECT COUNT(*) AS n FROM tenure_leases");
            let mut rotated = 0;
            for _ in 0..1000 {
                if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
                    rotated += 1;
                    if rotated == 2 {
                        break;
                    }
                }
            }
            assert_eq!(rotated, 2, "rotations beside the caller's read view");
            Ok(jobs::enqueue(c, &NewJob::new("q", "a", vec![]))?.id)
        })
        .unwrap();
    let (_, oldest) = slots(&mut conn);
    let slot = count(
        &mut conn,
        &format!("SELECT slot AS n FROM tenure_ready WHERE id = {id}"),
    );
    assert_eq!(
        slot, oldest,
        "the entry went to the slot of the caller's read view, the next one emptied"
    );
    for round in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
        assert_ring_exact(&mut conn, backend, &format!("after rotation {round}"));
    }
    assert_eq!(drain(&mut conn), vec![id], "the job, once");
}

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

/// The ring's migration (`tenure-0045_ready_ring/up.sql`) on a live database while a
/// rotation runs between two of its statements, as another process's worker may: the
/// migration is one batch whose statements each commit on their own, and `rotate_ready` takes
/// no migration lock (its `LOCK TABLES ... NOWAIT` is granted between two statements). The
/// rotation moves the generation on, an enqueue's trigger then puts its entry in slot 1,
/// and the migration's last statement (`INSERT IGNORE ... SELECT 0, id ...`) adds a second
/// entry for the same job in slot 0: IGNORE only skips an entry of the same slot. The ring
/// must hold one entry per waiting job.
#[test]
fn mysql_a_rotation_during_the_rings_migration_leaves_one_entry_per_job() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut migrator = db.connect();
    let mut worker = db.connect();
    migrator
        .batch_execute(include_str!(
            "../../../migrations/mysql/tenure-0045_ready_ring/down.sql"
        ))
        .unwrap();
    let before = jobs::enqueue(&mut worker, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    // The migration's statements in its order, split before its last one.
    let up = include_str!("../../../migrations/mysql/tenure-0045_ready_ring/up.sql");
    let (head, last) = up
        .rsplit_once("INSERT IGNORE INTO tenure_ready ")
        .expect("the migration ends with the waiting jobs' entries");
    migrator.batch_execute(head).unwrap();
    // Between two statements: a worker's rotation, then an enqueue.
    assert!(
        jobs::rotate_ready(&mut worker, NO_WAIT).unwrap().is_some(),
        "a rotation between two of the migration's statements"
    );
    let during = jobs::enqueue(&mut worker, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    migrator
        .batch_execute(&format!("INSERT IGNORE INTO tenure_ready {last}"))
        .unwrap();
    let entries = count(
        &mut worker,
        &format!("SELECT COUNT(*) AS n FROM tenure_ready WHERE id = {during}"),
    );
    println!("job {before} waited before the migration; job {during} has {entries} entries");
    let taken: Vec<i64> = jobs::claim(&mut worker, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    println!("a claim took {taken:?}");
    assert_eq!(
        entries, 1,
        "the job enqueued during the migration has {entries} entries in the ring"
    );
    assert_ring_exact(&mut worker, backend, "after the migration");
}

/// A rotation from a session whose time zone is east of UTC (a user's own connection, as
/// `connect_raw` gives, in the server's default zone or one set for its own queries: every
/// other statement of tenure reads `UTC_TIMESTAMP(6)`, "whatever the session's time zone")
/// writes `rotated_at` by `NOW(6)`, ten hours ahead of tenure's UTC sessions. Then a forced
/// rotation (`min_interval` zero) from tenure's own session must still run; it says "not
/// due" (`None`) for ten hours, and the ring stops rotating.
#[test]
fn mysql_a_rotation_from_a_session_east_of_utc_does_not_stop_the_ring() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut east = db.connect_raw();
    east.batch_execute("SET time_zone = '+10:00'").unwrap();
    assert!(
        jobs::rotate_ready(&mut east, NO_WAIT).unwrap().is_some(),
        "the first rotation, from the session at +10:00"
    );
    let mut conn = db.connect();
    let later: Vec<Option<u64>> = (0..3)
        .map(|_| jobs::rotate_ready(&mut conn, NO_WAIT).unwrap())
        .collect();
    assert!(
        later.iter().all(Option::is_some),
        "forced rotations from tenure's UTC session after one from +10:00: {later:?}"
    );
}

/// `tenure_ready_ring`'s one row gone (deleted by hand, a restore that left it out): a
/// forced rotation cannot run, and must say so (an error), not answer `None` as if it were
/// merely not due (`None` is documented for: not due, another rotation, the slot busy, a
/// backlog, a backend without a ring). Enqueues fail meanwhile (their trigger reads no slot).
#[test]
fn mysql_a_rotation_without_its_ring_row_is_an_error() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute("DELETE FROM tenure_ready_ring").unwrap();
    let enqueued = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]));
    println!("an enqueue without the ring row: {enqueued:?}");
    let rotated = jobs::rotate_ready(&mut conn, NO_WAIT);
    assert!(
        rotated.is_err(),
        "a forced rotation without the ring's row: {rotated:?}"
    );
}

/// An application's own `UPDATE` of a waiting job's id (a renumbering, a merge of two
/// databases' jobs): the update trigger compares the claim columns but not the id, so the
/// entry keeps the old id, which no job has; the job itself has none and is never claimed.
#[test]
fn mysql_an_applications_update_of_a_waiting_jobs_id_moves_its_entry() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let renumbered = id + 1000;
    conn.batch_execute(&format!(
        "UPDATE tenure_jobs SET id = {renumbered} WHERE id = {id}"
    ))
    .unwrap();
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    println!("a claim after the renumbering took {taken:?}");
    assert_ring_exact(&mut conn, backend, "after a waiting job's id changed");
}

/// An application empties `tenure_jobs` with `TRUNCATE TABLE` (a reset, a test fixture): no
/// row trigger fires, so the waiting jobs' entries stay, and InnoDB starts the ids again at
/// 1. The next job (queue `new`, due in an hour) gets the old job's id: the stale entry (queue
/// `old`, due now) joins it, and a claim of queue `old` takes it, in the wrong queue an hour
/// early. The ring must not outlive the jobs it lists.
#[test]
fn mysql_truncating_the_jobs_table_leaves_no_entry_behind() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let old = jobs::enqueue(&mut conn, &NewJob::new("old", "a", vec![]))
        .unwrap()
        .id;
    // The next entries go to another slot than the old job's (in the same slot, the new
    // job's entry collides with the stale one and its enqueue fails).
    assert!(jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some());
    conn.batch_execute("TRUNCATE TABLE tenure_jobs").unwrap();
    let new = jobs::enqueue(
        &mut conn,
        &NewJob::new("new", "b", vec![]).delay(std::time::Duration::from_secs(3600)),
    )
    .unwrap()
    .id;
    println!("the old job was {old}, the new one is {new}");
    let taken: Vec<(i64, String, String)> = jobs::claim(&mut conn, "old", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| (j.id, j.queue.clone(), j.due_at.to_rfc3339()))
        .collect();
    assert!(
        taken.is_empty(),
        "a claim of queue `old` took {taken:?} (queue `new`, due in an hour)"
    );
    assert_ring_exact(&mut conn, backend, "after TRUNCATE TABLE tenure_jobs");
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
        assert_ring_exact(&mut conn, backend, &format!("after failed rotation {round}"));
    }
    let second = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    assert_eq!(drain(&mut conn), vec![first, second], "each job once");
}

/// Promise 3 with real threads: a rotator rotates as fast as it can while a killer, on its
/// own connection, sends it `KILL QUERY` (the rotator keeps its connection, as a pool would)
/// and now and then `KILL` (the rotator connects again), at varying moments; an enqueuer
/// and a claimer run meanwhile (a tenth of the jobs due in ten minutes, moved at every
/// rotation). After each rotation call the rotator's connection reads another table (it is
/// not left under `LOCK TABLES`). At the end the ring is exact after more rotations, and
/// every job due now is claimed exactly once.
#[test]
fn mysql_rotations_killed_at_any_moment_lose_nothing() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let backend = Backend::Mysql;
    let db = Arc::new(TestDb::migrated(backend));
    let stop = Arc::new(AtomicBool::new(false));
    let session = Arc::new(AtomicI64::new(0));
    let outcomes: Arc<Mutex<HashMap<&'static str, usize>>> = Arc::default();
    let rotator = {
        let (db, stop, session, outcomes) =
            (db.clone(), stop.clone(), session.clone(), outcomes.clone());
        std::thread::spawn(move || {
            let mut conn = db.connect();
            session.store(
                count(&mut conn, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n"),
                Ordering::SeqCst,
            );
            while !stop.load(Ordering::SeqCst) {
                let outcome = match jobs::rotate_ready(&mut conn, NO_WAIT) {
                    Ok(Some(_)) => "rotated",
                    Ok(None) => "none",
                    Err(_) => "error",
                };
                *outcomes.lock().unwrap().entry(outcome).or_default() += 1;
                // Usable, unlocked (a killed query here is tried again), or gone (killed).
                let mut lost = false;
                for _ in 0..5 {
                    match diesel::sql_query("SELECT id FROM tenure_leases LIMIT 1")
                        .execute(&mut conn)
                    {
                        Ok(_) => break,
                        Err(e) if e.to_string().contains("interrupted") => continue,
                        Err(e) if e.to_string().contains("LOCK TABLES") => {
                            panic!("the rotator's connection was left locked: {e}")
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
                    session.store(
                        count(&mut conn, "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n"),
                        Ordering::SeqCst,
                    );
                }
            }
        })
    };
    let killer = {
        let (mut conn, stop, session) = (db.connect(), stop.clone(), session.clone());
        std::thread::spawn(move || {
            let mut kills = 0usize;
            let mut step = 1u64;
            while !stop.load(Ordering::SeqCst) {
                step = step.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                std::thread::sleep(Duration::from_micros(step >> 54));
                let target = session.load(Ordering::SeqCst);
                let kind = if (step >> 20) % 8 == 0 { "" } else { "QUERY " };
                // The target may have gone already (reconnecting): an error then.
                let _ = conn.batch_execute(&format!("KILL {kind}{target}"));
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
    for i in 0..1500 {
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
        if i % 100 == 0 {
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
    assert!(early.is_empty(), "jobs due in ten minutes claimed: {early:?}");
}

/// Promise 6 with real threads: two callers run REPEATABLE READ transactions whose read view
/// starts (a read of the job) before a pause in which a fast rotator rotates, then cancel the
/// job, replace it (due in ten minutes, or now) or enqueue a fresh one, and commit; two
/// claimers claim meanwhile. Each caller's change commits or fails retryably (1412) with
/// nothing changed; no claim takes a job before its due time (a stale entry with the old
/// due time would), none twice; the ring ends exact.
#[test]
fn mysql_repeatable_read_callers_racing_rotations_keep_the_ring_exact() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tenure::jobs::OnDuplicate;

    const KEYS: usize = 40;
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for k in 0..KEYS {
        let job = NewJob::new("rr", "a", vec![]).dedup_key(format!("k{k}"));
        ids.push(jobs::enqueue(&mut conn, &job).unwrap().id);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (rotator, rotations) =
        super::spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(1));
    let claimed: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let (mut conn, stop, claimed) = (db.connect(), stop.clone(), claimed.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let batch = jobs::claim(&mut conn, "rr", 5, TTL).expect("claim must not fail");
                    for job in &batch {
                        assert!(
                            job.due_at <= job.claimed_at,
                            "job {} claimed at {} before its due time {}",
                            job.id,
                            job.claimed_at,
                            job.due_at
                        );
                        *claimed.lock().unwrap().entry(job.id).or_default() += 1;
                    }
                    if !batch.is_empty() {
                        jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        })
        .collect();
    let callers: Vec<_> = (0..2u64)
        .map(|n| {
            let mut conn = db.connect();
            let ids = ids.clone();
            std::thread::spawn(move || {
                conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .unwrap();
                let (mut committed, mut retryable) = (0, 0);
                for i in 0..150u64 {
                    let k = usize::try_from((i * 7 + n * 13) % KEYS as u64).unwrap();
                    let outcome = conn.transaction::<_, Error, _>(|c| {
                        // The read view starts here.
                        jobs::get(c, ids[k])?;
                        std::thread::sleep(Duration::from_millis(3 + i % 5));
                        let keyed = NewJob::new("rr", "a", vec![]).dedup_key(format!("k{k}"));
                        match i % 4 {
                            0 => {
                                jobs::cancel(c, ids[k])?;
                                Ok(())
                            }
                            1 => {
                                let later = keyed
                                    .delay(Duration::from_secs(600))
                                    .on_duplicate(OnDuplicate::Replace);
                                jobs::enqueue(c, &later)?;
                                Ok(())
                            }
                            2 => {
                                jobs::enqueue(c, &keyed.on_duplicate(OnDuplicate::KeepEarlierDue))?;
                                Ok(())
                            }
                            _ => {
                                jobs::enqueue(c, &NewJob::new("rr", "b", vec![]))?;
                                Ok(())
                            }
                        }
                    });
                    match outcome {
                        Ok(()) => committed += 1,
                        Err(e) if e.is_retryable() => retryable += 1,
                        Err(e) => panic!("caller {n}, round {i}: not retryable: {e}"),
                    }
                }
                (committed, retryable)
            })
        })
        .collect();
    let (mut committed, mut retryable) = (0, 0);
    for caller in callers {
        let (c, r) = caller.join().unwrap();
        committed += c;
        retryable += r;
    }
    stop.store(true, Ordering::SeqCst);
    for claimer in claimers {
        claimer.join().unwrap();
    }
    rotator.join().unwrap();
    println!(
        "{committed} committed, {retryable} retryable failures, {} rotations",
        rotations.load(Ordering::SeqCst)
    );
    assert!(rotations.load(Ordering::SeqCst) >= 10, "too few rotations");
    let claimed = claimed.lock().unwrap();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "claimed twice: {twice:?}");
    assert_ring_exact(&mut conn, backend, "after the race");
    for _ in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    assert_ring_exact(&mut conn, backend, "after more rotations");
}

/// A TCP proxy to the test server that forwards everything, but holds the first client
/// packet containing `pattern` for `hold` (a slow or lossy network: TCP retransmits after
/// growing pauses; or a client frozen between two statements). Returns its port and a flag
/// set while it holds the packet.
fn holding_proxy(
    upstream: std::net::SocketAddr,
    pattern: &'static [u8],
    hold: std::time::Duration,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let holding = Arc::new(AtomicBool::new(false));
    let armed = Arc::new(AtomicBool::new(true));
    let flag = holding.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { return };
            let Ok(mut server) = TcpStream::connect(upstream) else {
                return;
            };
            let (mut client_in, mut server_out) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (armed, flag) = (armed.clone(), flag.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = match client_in.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let packet = &buf[..n];
                    if packet.windows(pattern.len()).any(|w| w == pattern)
                        && armed.swap(false, Ordering::SeqCst)
                    {
                        flag.store(true, Ordering::SeqCst);
                        std::thread::sleep(hold);
                        flag.store(false, Ordering::SeqCst);
                    }
                    if server_out.write_all(packet).is_err() {
                        break;
                    }
                }
                let _ = server_out.shutdown(std::net::Shutdown::Both);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut server, &mut client);
                let _ = client.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (port, holding)
}

/// Promise 4 (a rotation never makes claims wait long): a worker's rotation whose last
/// statement (`UNLOCK TABLES`) is held up on the way (the proxy above holds it five seconds:
/// a network stall, or a process frozen between two statements) keeps the ring's table lock
/// for that long, and every claim and enqueue of the database waits behind it (MariaDB's
/// metadata lock wait, `lock_wait_timeout`: a day by default; tenure sets none), where
/// claims otherwise skip what others hold. A claim on another connection must not wait for
/// the stalled rotation.
#[test]
fn mysql_a_stalled_rotation_does_not_stop_every_claim() {
    use std::sync::atomic::Ordering;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let mut url = url::Url::parse(db.url()).unwrap();
    let upstream = (
        url.host_str().unwrap().to_string(),
        url.port().unwrap_or(3306),
    );
    let upstream = std::net::ToSocketAddrs::to_socket_addrs(&upstream)
        .unwrap()
        .next()
        .unwrap();
    let hold = Duration::from_secs(5);
    let (port, holding) = holding_proxy(upstream, b"UNLOCK TABLES", hold);
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(port)).unwrap();
    let mut stalled = AnyConnection::connect(url.as_str()).expect("through the proxy");
    let rotator = std::thread::spawn(move || jobs::rotate_ready(&mut stalled, NO_WAIT));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !holding.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the rotation never reached its UNLOCK");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (sender, receiver) = mpsc::channel();
    let claimer = {
        let mut conn = db.connect();
        std::thread::spawn(move || {
            let started = Instant::now();
            let taken = jobs::claim(&mut conn, "q", 10, TTL).map(|b| b.len());
            sender.send(started.elapsed()).unwrap();
            taken
        })
    };
    let waited = receiver.recv_timeout(Duration::from_secs(2));
    let rotated = rotator.join().unwrap();
    let taken = claimer.join().unwrap();
    println!("the rotation: {rotated:?}; the claim of job {id}: {taken:?}");
    let waited = waited.unwrap_or_else(|_| receiver.recv().unwrap());
    assert!(
        waited < Duration::from_secs(2),
        "a claim waited {waited:?} behind a rotation whose UNLOCK TABLES was held up {hold:?}"
    );
}

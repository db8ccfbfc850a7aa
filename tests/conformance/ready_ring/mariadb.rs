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

//! PostgreSQL's job slots (docs/storage-design.md): `tenure_jobs` is partitioned into six
//! slots that new jobs fill in turn, and `kept` for jobs with a dedup key. Finished work is
//! reclaimed by truncating whole slots, never a job still there, so a job's life leaves no dead
//! row versions behind for claims to walk once its slot is gone. MariaDB and SQLite keep one
//! table: `rotate_job_slots` and `reclaim_job_slots` do nothing there (their doctests).
//!
//! - `rotation` — a slot is truncated only once it holds no job; a live database moves in.
//! - `rotation_races` — rotations racing COPY bulks, callers' open transactions, every keyed
//!   path, a killed rotation, grants from before the migration, a report holding the slots.
//! - `reclaim` — retention by slot: a slot goes whole only when retention would delete every
//!   job in it, with the rows beside its jobs; reclaims racing claims, finishes, dependents.
//! - `rotation_locks` — a rotation never waits long: a report holding the slots starts a
//!   backoff; a VACUUM of the current slot does not hold up its ANALYZE.
//! - `reclaim_deadlocks` — finishes settling dependency edges beside the reclaim, alone or in
//!   a caller's transaction: never a deadlock.
//! - `reclaim_races` — row locks, callers' transactions, `retry_dead` and a second
//!   reclaimer racing the reclaim's lock: no deadlock, no lost finish, nothing kept lost.
//! - `bulk_and_rescue_races` — bulks whose slot was read before a rotation or a reclaim,
//!   rescues and cancels racing the reclaim of their jobs' slot: each job once.
//! - `live_jobs_in_old_slots` — parked jobs, steps, retries, snoozes, results and workflows
//!   in an old slot: nothing taken until the slot's last job may go.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use tenure::AnyConnection;
use tenure::jobs::{self, Finished, Outcome, Retention};

use crate::common::count;

mod bulk_and_rescue_races;
mod live_jobs_in_old_slots;
mod reclaim;
mod reclaim_deadlocks;
mod reclaim_races;
mod rotation;
mod rotation_locks;
mod rotation_races;

/// Policies deleting every finished job of `queues` at once.
fn delete_all(queues: &[&str]) -> Vec<(String, Finished, Retention)> {
    queues
        .iter()
        .flat_map(|q| {
            [Finished::Completed, Finished::Dead, Finished::Cancelled]
                .map(|f| (q.to_string(), f, Retention::DeleteAll))
        })
        .collect()
}

/// One rotation, due whatever the last one was: the slot it made current, if any.
fn rotate(conn: &mut AnyConnection) -> Option<u64> {
    jobs::rotate_job_slots(conn, Duration::ZERO).unwrap()
}

/// The slot a job is in (-1: `kept`).
fn slot_of(conn: &mut AnyConnection, id: i64) -> i64 {
    count(
        conn,
        &format!("SELECT slot::bigint AS n FROM tenure_jobs WHERE id = {id}"),
    )
}

/// Pages a slot's table holds (0 once truncated).
fn pages(conn: &mut AnyConnection, slot: i64) -> i64 {
    count(
        conn,
        &format!("SELECT (pg_relation_size('tenure_jobs_{slot}') / 8192)::bigint AS n"),
    )
}

/// The current slot (the one new jobs go into).
fn current_slot(conn: &mut AnyConnection) -> i64 {
    count(
        conn,
        "SELECT pg_sequence_last_value('tenure_jobs_slot')::bigint AS n",
    )
}

/// The server's count of deadlocks in this database, read until it settles.
fn deadlocks(conn: &mut AnyConnection) -> i64 {
    let mut n = 0;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        n = n.max(count(
            conn,
            "SELECT deadlocks AS n FROM pg_stat_database WHERE datname = current_database()",
        ));
    }
    n
}

/// A thread that reclaims (DeleteAll of `queues`) and, if `rotating`, rotates as fast as it
/// can until `stop`: (reclaimed slots, rotations, errors seen).
fn churn(
    url: String,
    queues: &'static [&'static str],
    rotating: bool,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(usize, usize, Vec<String>)> {
    std::thread::spawn(move || {
        let mut c = AnyConnection::connect(&url).unwrap();
        let (mut reclaimed, mut rotations, mut errors) = (0, 0, Vec::new());
        while !stop.load(Ordering::Relaxed) {
            match jobs::reclaim_job_slots(&mut c, &delete_all(queues)) {
                Ok(r) => reclaimed += r.slots,
                Err(e) => errors.push(format!("reclaim: {e}")),
            }
            if rotating {
                match jobs::rotate_job_slots(&mut c, Duration::ZERO) {
                    Ok(Some(_)) => rotations += 1,
                    Ok(None) => {}
                    Err(e) => errors.push(format!("rotate: {e}")),
                }
            }
        }
        (reclaimed, rotations, errors)
    })
}

/// Fills slot `slot` with `n` cancelled jobs of `queue` that finished an hour ago (by SQL:
/// the shape a drain leaves, quickly), so that the reclaim's check under its lock reads a
/// slot of some size and holds the lock for tens of milliseconds.
fn fill_cancelled(conn: &mut AnyConnection, slot: i64, queue: &str, n: i64) {
    conn.batch_execute(&format!(
        "INSERT INTO tenure_jobs_{slot} (id, queue, kind, payload, state, max_attempts, due_at, \
         created_at, finished_at, slot) \
         SELECT nextval('tenure_jobs_id_seq'), '{queue}', 'filler', ''::bytea, 'cancelled', 1, \
         now() - interval '1 hour', now() - interval '1 hour', now() - interval '1 hour', {slot} \
         FROM generate_series(1, {n})"
    ))
    .unwrap();
}

fn exclusive_lock_on(conn: &mut AnyConnection, slot: i64) -> bool {
    count(
        conn,
        &format!(
            "SELECT COUNT(*) AS n FROM pg_locks WHERE relation = 'tenure_jobs_{slot}'::regclass \
             AND mode = 'AccessExclusiveLock' AND granted"
        ),
    ) > 0
}

/// Claims and completes every due job of `queue`: the ids, each once.
fn drain(conn: &mut AnyConnection, queue: &str) -> Vec<i64> {
    let mut ids = Vec::new();
    loop {
        let batch = jobs::claim(conn, queue, 100, Duration::from_secs(60)).unwrap();
        if batch.is_empty() {
            return ids;
        }
        ids.extend(batch.iter().map(|j| j.id));
        let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
        let done = jobs::complete(conn, &claims).unwrap();
        assert!(done.iter().all(|o| *o == Outcome::Done), "{done:?}");
    }
}

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
//! - `reclaim_races` — finishes, row locks, callers' transactions, `retry_dead` and a second
//!   reclaimer racing the reclaim's lock: no deadlock, no lost finish, nothing kept lost.

use std::time::Duration;

use tenure::AnyConnection;
use tenure::jobs::{self, Finished, Retention};

use crate::common::count;

mod attacks;
mod reclaim;
mod reclaim_races;
mod rotation;
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

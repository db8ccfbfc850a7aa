//! Attacks on flow control (round 18c): queue-wide limits set while claims are in flight,
//! and other timings around the claim's admission.

use std::time::Duration;

use dibs::Backend;
use dibs::jobs::{self, NewJob};
use diesel::connection::SimpleConnection;

use crate::support::{TestDb, conformance, count};

conformance!(a_queue_limit_set_during_an_in_flight_claim_is_never_exceeded,);

const TTL: Duration = Duration::from_secs(600);

/// Queue `q` has no limit. Claim A (kind `a`, its job carries a concurrency cap on key `k`)
/// picks its job, seeing no queue limit, and waits for `k`'s lock (held here by another
/// transaction, as a claim of `k` elsewhere would). Meanwhile `limit_queue(q, 1)` commits,
/// with nothing of `q` running, and claim B (kind `b`, no key) claims one job: it is the
/// first claim under the limit and finds the queue empty. Then `k`'s lock is released and
/// A goes on: it decides on the queue limit its pick read (none) and takes no queue lock,
/// so it claims too: two running jobs in a queue limited to one, though the limit was
/// set while none ran. No serial order of A, the limit and B gives that (B after the limit
/// would count A's job if A came before the limit, and A after the limit would be held to
/// it). SQLite's IMMEDIATE claim transaction serializes everything: nothing to interleave.
fn a_queue_limit_set_during_an_in_flight_claim_is_never_exceeded(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).limit("k", 10)).unwrap();
    jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![])).unwrap();
    // Hold k's lock as a claim would (the key's row, locked until rollback).
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; INSERT INTO dibs_limit_keys (limit_key) VALUES ('k')")
        .unwrap();
    let mut a_conn = db.connect();
    let a = std::thread::spawn(move || {
        jobs::claim_kinds(&mut a_conn, "q", &["a"], 1, TTL).unwrap().len()
    });
    // A has picked and waits for k's lock.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(!a.is_finished(), "claim A did not wait for k's lock");
    jobs::limit_queue(&mut conn, "q", Some(1)).unwrap();
    let b = jobs::claim_kinds(&mut conn, "q", &["b"], 1, TTL).unwrap().len();
    holder.batch_execute("ROLLBACK").unwrap();
    let a = a.join().unwrap();
    let running = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM dibs_jobs WHERE queue = 'q' AND state = 'running'",
    );
    assert!(
        running <= 1,
        "{running} jobs of q run under a queue limit of 1 (claim A took {a}, claim B took {b})"
    );
}

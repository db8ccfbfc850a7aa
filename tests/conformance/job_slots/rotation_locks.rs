//! A rotation never waits long for a lock (PostgreSQL's job slots): a report's open
//! transaction holding the slots starts a backoff instead of queueing claims behind the
//! rotation, and a VACUUM of the current slot does not hold up its ANALYZE.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, Finished, NewJob, Retention};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

use super::{drain, rotate};

/// A transaction that used `tenure_jobs` and stays open (a report) holds every slot's lock for
/// its whole length. The first version waited for the lock up to 370 ms a call, each second,
/// and every claim arriving meanwhile queued behind it: a third of the claims' time held up
/// for as long as the report stayed open (a helper's attack measured 747 ms of 2.4 s). Now
/// only one try waits (20 ms), and a failed wait starts a backoff that doubles: calls during
/// it do not ask for the lock at all (the failure count stays), and the first success resets it.
#[test]
fn postgres_a_rotation_backs_off_while_a_report_holds_the_slot() {
    #[derive(QueryableByName)]
    struct Backoff {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        failures: i32,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        waiting: bool,
    }
    let backoff = |conn: &mut AnyConnection| {
        diesel::sql_query(
            "SELECT failures, COALESCE(retry_at > statement_timestamp(), false) AS waiting \
             FROM tenure_jobs_rotation",
        )
        .get_result::<Backoff>(conn)
        .unwrap()
    };
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let mut reader = db.connect();
    // Slot 0 empty (its job done and pruned), current slot 1; every other slot then holds a
    // job, so that slot 0 is the only one that could turn.
    jobs::enqueue(&mut conn, &NewJob::new("s", "a", vec![])).unwrap();
    drain(&mut conn, "s");
    assert_eq!(rotate(&mut conn), Some(1));
    jobs::prune(
        &mut conn,
        "s",
        Finished::Completed,
        Retention::DeleteAll,
        10,
    )
    .unwrap();
    for slot in 2..6 {
        jobs::enqueue(&mut conn, &NewJob::new("hold", "a", vec![])).unwrap();
        assert_eq!(rotate(&mut conn), Some(slot));
    }
    jobs::enqueue(&mut conn, &NewJob::new("hold", "a", vec![])).unwrap();
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM tenure_jobs")
        .unwrap();
    // The wait fails: a backoff starts, of 100 ms from the call.
    let before = count(
        &mut conn,
        "SELECT (extract(epoch FROM statement_timestamp()) * 1e6)::bigint AS n",
    );
    assert_eq!(rotate(&mut conn), None);
    assert_eq!(backoff(&mut conn).failures, 1);
    let retry_at = |conn: &mut AnyConnection| {
        count(
            conn,
            "SELECT (extract(epoch FROM retry_at) * 1e6)::bigint AS n FROM tenure_jobs_rotation",
        )
    };
    assert!(retry_at(&mut conn) >= before + 100_000);
    // A call during the backoff does not try the lock (were it to, the count would grow).
    conn.batch_execute("UPDATE tenure_jobs_rotation SET retry_at = now() + interval '1 hour'")
        .unwrap();
    assert_eq!(rotate(&mut conn), None);
    assert_eq!(
        backoff(&mut conn).failures,
        1,
        "a call during the backoff tried the lock"
    );
    // Past it, one more failed wait, and twice the backoff.
    conn.batch_execute("UPDATE tenure_jobs_rotation SET retry_at = now() - interval '1 second'")
        .unwrap();
    let before = count(
        &mut conn,
        "SELECT (extract(epoch FROM statement_timestamp()) * 1e6)::bigint AS n",
    );
    assert_eq!(rotate(&mut conn), None);
    assert_eq!(backoff(&mut conn).failures, 2);
    assert!(retry_at(&mut conn) >= before + 200_000);
    reader.batch_execute("COMMIT").unwrap();
    // Once the report ends, the first call past the backoff turns slot 0, and the count resets.
    let turned = loop {
        if let Some(slot) = rotate(&mut conn) {
            break slot;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(turned, 0);
    let after = backoff(&mut conn);
    assert!(after.failures == 0 && !after.waiting);
}

/// A VACUUM (or ANALYZE) of the current slot holds its SHARE UPDATE EXCLUSIVE lock, which the
/// rotation's ANALYZE of a slot that has doubled needs. The rotation waited for it without
/// bound, holding the rotation's lock (and so every rotation and reclaim) for as long as the
/// VACUUM ran; now it gives the ANALYZE 20 ms and goes on. The holder here keeps the lock
/// until the rotation returns or 20 s pass: a rotation that waits returns only after
/// the release, whatever the machine's speed.
#[test]
fn postgres_a_rotation_does_not_wait_for_a_vacuum_of_the_current_slot() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    // Past the 16 pages after which the rotation analyzes the current slot (slot 0).
    let batch: Vec<NewJob> = (0..3_000)
        .map(|i| NewJob::new("v", "a", vec![7; 64]).priority(i % 3))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    assert!(
        count(
            &mut conn,
            "SELECT (pg_relation_size('tenure_jobs_0') / 8192)::bigint AS n"
        ) > 16
    );
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; LOCK TABLE tenure_jobs_0 IN SHARE UPDATE EXCLUSIVE MODE")
        .unwrap();
    let rotated = Arc::new(AtomicBool::new(false));
    let released = Arc::new(AtomicBool::new(false));
    let rotator = {
        let (url, rotated, released) = (db.url().to_string(), rotated.clone(), released.clone());
        std::thread::spawn(move || {
            let mut c = AnyConnection::connect(&url).unwrap();
            let turned = jobs::rotate_job_slots(&mut c, Duration::ZERO);
            let before_release = !released.load(Ordering::SeqCst);
            rotated.store(true, Ordering::SeqCst);
            (turned, before_release)
        })
    };
    let start = Instant::now();
    while !rotated.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    released.store(true, Ordering::SeqCst);
    holder.batch_execute("ROLLBACK").unwrap();
    let (turned, before_release) = rotator.join().unwrap();
    assert!(
        before_release,
        "the rotation waited for the VACUUM's lock until it was released"
    );
    // Slot 0 holds jobs: the rotation turned to slot 1, the ANALYZE given up.
    assert_eq!(turned.unwrap(), Some(1));
}

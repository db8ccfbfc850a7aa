//! Bulk enqueue at the edges: every field the same by COPY and by INSERT, batches of 63, 64 and
//! 65, concurrent bulk enqueues and claims, and a caller's failed transaction.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use diesel::connection::SimpleConnection;
use tenure::jobs::{self, Job, NewJob};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count, race};

conformance!(
    edge_fields_are_the_same_by_copy_and_by_insert,
    batches_of_63_64_and_65_agree,
    concurrent_bulk_enqueues_and_claims_never_mix_ids,
    a_callers_failed_transaction_refuses_a_long_batch_cleanly,
);

/// The edge cases of every field a plain job has.
fn edge_jobs() -> Vec<NewJob> {
    let first = Utc.with_ymd_and_hms(1, 1, 1, 0, 0, 0).unwrap();
    let last = Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap()
        + TimeDelta::nanoseconds(999_999_999);
    let before_2000 = Utc.with_ymd_and_hms(1999, 12, 31, 23, 59, 59).unwrap()
        + TimeDelta::nanoseconds(123_456_789);
    let after_2000 =
        Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 0).unwrap() + TimeDelta::nanoseconds(987_654_321);
    let max_delay = tenure::MAX_TTL;
    let mut out = Vec::new();
    for i in 0..64 {
        let payload = match i % 5 {
            0 => vec![],
            1 => vec![0u8],
            2 => (0..=255u8).collect(),
            3 => vec![0xff; 3],
            _ => b"\\x00".to_vec(),
        };
        let job = NewJob::new(["a", "b", "ü"][i % 3], format!("kind-{i}"), payload)
            .priority([i32::MIN, i32::MAX, 0, -1][i % 4])
            .max_attempts([1, jobs::MAX_ATTEMPTS, 25][i % 3]);
        let job = match i % 9 {
            0 => job.at(first),
            1 => job.at(last),
            2 => job.at(before_2000),
            3 => job.at(after_2000),
            4 => job.delay(max_delay),
            5 => job.delay(Duration::from_nanos(1_999)),
            6 => job.delay(Duration::ZERO),
            7 => job.delay(Duration::from_secs(86_400 * 200 + 1)),
            _ => job,
        };
        let job = match i % 4 {
            0 => job.rate_limit("r", 5, Duration::from_secs(1)).limit("c", 2),
            1 => job
                .limit("c", 2)
                .rate_limit("r2", 1, Duration::from_millis(1)),
            2 => job.rate_limit("only-rate", 3, tenure::MAX_TTL),
            _ => job,
        };
        out.push(job);
    }
    out
}

/// A job as stored, with what differs between two enqueues of it (id, clock) taken out: the
/// due time relative to the creation when the job was given a delay.
fn normal(mut job: Job, relative: bool) -> Job {
    job.id = 0;
    if relative {
        job.due_at = DateTime::<Utc>::UNIX_EPOCH + (job.due_at - job.created_at);
    }
    job.created_at = DateTime::<Utc>::UNIX_EPOCH;
    job
}

fn stored(conn: &mut AnyConnection, ids: &[i64], relative: &[bool]) -> Vec<(Job, Vec<String>)> {
    ids.iter()
        .zip(relative)
        .map(|(id, rel)| {
            let job = jobs::get(conn, *id).unwrap().expect("the job");
            let mut limits: Vec<String> = jobs::limits_of(conn, *id)
                .unwrap()
                .iter()
                .map(|l| format!("{l:?}"))
                .collect();
            limits.sort();
            (normal(job, *rel), limits)
        })
        .collect()
}

fn edge_fields_are_the_same_by_copy_and_by_insert(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch = edge_jobs();
    let relative: Vec<bool> = (0..batch.len()).map(|i| i % 9 >= 4).collect();
    // One batch of 64 (COPY on PostgreSQL), and the same jobs one at a time (INSERT).
    let copied: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    let inserted: Vec<i64> = batch
        .iter()
        .map(|job| jobs::enqueue(&mut conn, job).unwrap().id)
        .collect();
    let by_copy = stored(&mut conn, &copied, &relative);
    let by_insert = stored(&mut conn, &inserted, &relative);
    for (i, (c, s)) in by_copy.iter().zip(&by_insert).enumerate() {
        assert_eq!(c, s, "job {i}: by the batch, then alone");
    }
}

fn batches_of_63_64_and_65_agree(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for n in [63usize, 64, 65] {
        let queue = format!("q{n}");
        let batch: Vec<NewJob> = (0..n)
            .map(|i| {
                NewJob::new(queue.as_str(), "k", (i as u32).to_be_bytes().to_vec())
                    .limit(format!("l{n}-{}", i % 2), 1)
            })
            .collect();
        let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect();
        for (i, id) in ids.iter().enumerate() {
            let job = jobs::get(&mut conn, *id).unwrap().unwrap();
            assert_eq!(job.payload, (i as u32).to_be_bytes(), "n={n} position {i}");
            assert_eq!(job.limit_key, Some(format!("l{n}-{}", i % 2)));
        }
        // FIFO: equal priority and due time claim in the batch's order.
        let claimed = jobs::claim(&mut conn, &queue, 1000, Duration::from_secs(60)).unwrap();
        let got: Vec<i64> = claimed.iter().map(|j| j.id).collect();
        assert_eq!(
            got,
            [ids[0], ids[1]],
            "n={n}: one job per key, the oldest of each"
        );
    }
}

/// Three bulk enqueuers (batches of 64 to 130, copied on PostgreSQL), one single enqueuer
/// and one claimer at once: every id returned is the job at its position, and no job is
/// claimed twice or lost.
fn concurrent_bulk_enqueues_and_claims_never_mix_ids(backend: Backend) {
    let db = TestDb::migrated(backend);
    let rounds = 15;
    let results = race(&db, 5, move |t, conn| {
        let mut mine: Vec<(i64, Vec<u8>)> = Vec::new();
        let mut claimed: Vec<i64> = Vec::new();
        for round in 0..rounds {
            match t {
                0..=2 => {
                    let n = 64 + (round * 7 + t * 13) % 67;
                    let payloads: Vec<Vec<u8>> = (0..n)
                        .map(|i| format!("{t}/{round}/{i}").into_bytes())
                        .collect();
                    let batch: Vec<NewJob> = payloads
                        .iter()
                        .map(|p| NewJob::new("q", "k", p.clone()))
                        .collect();
                    let ids = jobs::enqueue_many(conn, &batch).unwrap();
                    assert_eq!(ids.len(), n);
                    for (e, payload) in ids.iter().zip(payloads) {
                        mine.push((e.id, payload));
                    }
                }
                3 => {
                    for i in 0..10 {
                        let payload = format!("{t}/{round}/{i}").into_bytes();
                        let e =
                            jobs::enqueue(conn, &NewJob::new("q", "k", payload.clone())).unwrap();
                        mine.push((e.id, payload));
                    }
                }
                _ => {
                    for job in jobs::claim(conn, "q", 50, Duration::from_secs(60)).unwrap() {
                        claimed.push(job.id);
                    }
                }
            }
        }
        (mine, claimed)
    });
    let mut conn = db.connect();
    let mut seen = HashSet::new();
    let mut all_claimed = HashSet::new();
    for (mine, claimed) in results {
        for (id, payload) in mine {
            assert!(seen.insert(id), "id {id} returned twice");
            let job = jobs::get(&mut conn, id).unwrap().expect("the job");
            assert_eq!(
                String::from_utf8_lossy(&job.payload),
                String::from_utf8_lossy(&payload),
                "id {id}"
            );
        }
        for id in claimed {
            assert!(all_claimed.insert(id), "job {id} claimed twice");
        }
    }
    let total = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs");
    assert_eq!(total as usize, seen.len());
}

fn a_callers_failed_transaction_refuses_a_long_batch_cleanly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..100).map(|_| NewJob::new("q", "k", vec![1])).collect();
    let outcome: Result<(), tenure::Error> = tenure::transaction(&mut conn, |conn| {
        jobs::enqueue(conn, &NewJob::new("q", "k", vec![])).unwrap();
        // A failed statement of the caller's own (on PostgreSQL it aborts the transaction;
        // elsewhere the transaction goes on).
        let _ = conn.batch_execute("SELECT * FROM no_such_table");
        let r = jobs::enqueue_many(conn, &batch);
        if backend == Backend::Postgres {
            assert!(r.is_err(), "{r:?}");
        }
        Err(diesel::result::Error::RollbackTransaction.into())
    });
    assert!(outcome.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    // The connection is usable.
    assert_eq!(jobs::enqueue_many(&mut conn, &batch).unwrap().len(), 100);
}

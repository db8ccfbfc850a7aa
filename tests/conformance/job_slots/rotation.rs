//! PostgreSQL's job slots (docs/storage-design.md, "What the records' step built"):
//! `tenure_jobs` is partitioned into six slots that new jobs fill in turn, and `kept` for
//! jobs with a dedup key. A rotation truncates a slot only once it holds no job, so nothing
//! waiting, running, blocked, parked or kept by retention is ever lost, whatever claims,
//! finishes and prunes race it; a job never moves; a live database's jobs move in with their
//! ids. (MariaDB and SQLite keep one table: `rotate_job_slots` does nothing there, proven by
//! its doctest.)

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, Finished, NewJob, Outcome, Retention};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

use super::{pages, rotate, slot_of};

const TTL: Duration = Duration::from_secs(60);

#[test]
fn postgres_a_slot_is_truncated_only_once_it_holds_no_job() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let plain = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let keyed = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).dedup_key("k"))
        .unwrap()
        .id;
    assert_eq!(slot_of(&mut conn, plain), 0);
    assert_eq!(slot_of(&mut conn, keyed), -1, "a keyed job lives in kept");
    // Its duplicate still folds into it (the key's index is kept's).
    let twin = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).dedup_key("k")).unwrap();
    assert!(twin.existing && twin.id == keyed);

    // Slot 0 holds a job: the rotation turns to slot 1, and slot 0 stays as it is.
    assert_eq!(rotate(&mut conn), Some(1));
    let second = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    assert_eq!(slot_of(&mut conn, second), 1);
    // Claimed and running for many rotations: never lost, its finish fenced as ever.
    let claimed = jobs::claim(&mut conn, "q", 3, TTL).unwrap();
    assert_eq!(claimed.len(), 3);
    for _ in 0..12 {
        rotate(&mut conn);
    }
    assert_eq!(slot_of(&mut conn, plain), 0, "a job never moves");
    let finished = jobs::complete(
        &mut conn,
        &claimed.iter().map(|j| j.claim()).collect::<Vec<_>>(),
    )
    .unwrap();
    assert_eq!(finished.len(), 3, "{finished:?}");
    assert!(pages(&mut conn, 0) > 0);
    // Finished but kept by retention: still there after more rotations.
    for _ in 0..6 {
        rotate(&mut conn);
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 3);
    // Pruned: the slots are empty, and each rotation truncates the next to nothing.
    let pruned = jobs::prune(
        &mut conn,
        "q",
        Finished::Completed,
        Retention::DeleteAll,
        100,
    )
    .unwrap();
    assert_eq!(pruned, 3);
    for _ in 0..6 {
        rotate(&mut conn).expect("a slot turned");
    }
    for slot in 0..6 {
        assert_eq!(pages(&mut conn, slot), 0, "slot {slot} truncated");
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    // A rotation too soon does nothing.
    assert_eq!(
        jobs::rotate_job_slots(&mut conn, Duration::from_secs(3600)).unwrap(),
        None
    );
}

/// A transaction that has used a slot keeps it from being truncated until it ends, without
/// anyone waiting (the rotation locks NOWAIT), and a keyed job is refused in a slot.
#[test]
fn postgres_an_open_transaction_holds_its_slot_and_nobody_waits() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let mut reader = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "q", 1, TTL).unwrap();
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    assert_eq!(rotate(&mut conn), Some(1));
    jobs::prune(
        &mut conn,
        "q",
        Finished::Completed,
        Retention::DeleteAll,
        10,
    )
    .unwrap();
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM tenure_jobs_0")
        .unwrap();
    // Slot 0 is empty but read by an open transaction: left alone, without waiting for it.
    let started = std::time::Instant::now();
    for _ in 0..3 {
        rotate(&mut conn);
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(pages(&mut conn, 0) > 0, "slot 0 still holds its dead row");
    reader.batch_execute("COMMIT").unwrap();
    for _ in 0..6 {
        rotate(&mut conn);
    }
    assert_eq!(pages(&mut conn, 0), 0);
    let refused = conn.batch_execute(&format!(
        "INSERT INTO tenure_jobs (queue, kind, payload, state, max_attempts, due_at, created_at, dedup_key, slot) \
         VALUES ('q', 'a', '', 'waiting', 1, now(), now(), 'k', {})",
        (id + 1) % 6
    ));
    assert!(refused.is_err(), "a keyed job in a slot is refused");
}

/// Four claimers, an enqueuer, a pruner and a rotator that turns the slots as fast as it can:
/// every job runs once and none is lost; slots keep being truncated.
#[test]
fn postgres_rotations_racing_claims_finishes_and_prunes_lose_nothing() {
    const JOBS: usize = 3000;
    let db = TestDb::migrated(Backend::Postgres);
    let done = Arc::new(AtomicBool::new(false));
    let completed = Arc::new(Mutex::new(Vec::<i64>::new()));
    let enqueued = Arc::new(Mutex::new(Vec::<i64>::new()));
    let mut threads = Vec::new();
    {
        let (url, enqueued) = (db.url().to_string(), enqueued.clone());
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            for chunk in 0..(JOBS / 100) {
                let batch: Vec<NewJob> = (0..100)
                    .map(|i| NewJob::new("race", "a", vec![]).priority(((chunk + i) % 3) as i32))
                    .collect();
                let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
                enqueued.lock().unwrap().extend(ids.iter().map(|e| e.id));
                // Spread over seconds, so that slots fill and empty while it runs.
                std::thread::sleep(Duration::from_millis(80));
            }
        }));
    }
    for _ in 0..4 {
        let (url, done, completed) = (db.url().to_string(), done.clone(), completed.clone());
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            while !done.load(Ordering::SeqCst) {
                let batch = jobs::claim(&mut conn, "race", 20, TTL).unwrap();
                if batch.is_empty() {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
                let finished = jobs::complete(&mut conn, &claims).unwrap();
                assert_eq!(finished.len(), claims.len(), "every claim finishes");
                completed.lock().unwrap().extend(batch.iter().map(|j| j.id));
            }
        }));
    }
    let turned = Arc::new(Mutex::new(0usize));
    {
        let (url, done, turned) = (db.url().to_string(), done.clone(), turned.clone());
        let completed = completed.clone();
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            while !done.load(Ordering::SeqCst) {
                jobs::prune(
                    &mut conn,
                    "race",
                    Finished::Completed,
                    Retention::DeleteAll,
                    500,
                )
                .unwrap();
                // Counted only while jobs still run: rotations that raced them.
                let racing = completed.lock().unwrap().len() < JOBS;
                if jobs::rotate_job_slots(&mut conn, Duration::ZERO)
                    .unwrap()
                    .is_some()
                    && racing
                {
                    *turned.lock().unwrap() += 1;
                }
            }
        }));
    }
    let mut conn = db.connect();
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while completed.lock().unwrap().len() < JOBS && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    done.store(true, Ordering::SeqCst);
    for thread in threads {
        thread.join().unwrap();
    }
    let completed = completed.lock().unwrap().clone();
    let unique: HashSet<i64> = completed.iter().copied().collect();
    assert_eq!(unique.len(), completed.len(), "a job ran twice");
    let enqueued: HashSet<i64> = enqueued.lock().unwrap().iter().copied().collect();
    assert_eq!(enqueued.len(), JOBS);
    assert_eq!(unique, enqueued, "every job ran once, none lost");
    assert!(
        *turned.lock().unwrap() >= 2,
        "the slots turned while jobs ran (the rotations raced them)"
    );
    let _ = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs");
}

/// A live database's jobs move into the slots with their ids, states and keys; ids go on
/// above them, keys still fold, and the waiting ones are claimed once each.
#[test]
fn postgres_a_live_database_moves_into_the_slots() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    // Jobs in every state, made with this build (its statements need the slots), then the
    // layout before the slots (down.sql), where the migration finds them.
    let plain: Vec<NewJob> = (0..200)
        .map(|_| NewJob::new("live", "a", vec![1]))
        .collect();
    jobs::enqueue_many(&mut conn, &plain).unwrap();
    let running = jobs::claim(&mut conn, "live", 10, TTL).unwrap();
    let finished = jobs::claim(&mut conn, "live", 10, TTL).unwrap();
    jobs::complete(
        &mut conn,
        &finished.iter().map(|j| j.claim()).collect::<Vec<_>>(),
    )
    .unwrap();
    conn.batch_execute(include_str!(
        "../../../migrations/postgres/tenure-0056_job_slots/down.sql"
    ))
    .unwrap();
    diesel::sql_query("DELETE FROM __diesel_schema_migrations WHERE version LIKE '%0056%'")
        .execute(&mut conn)
        .unwrap();
    // A keyed job as the layout before the slots had it.
    conn.batch_execute(
        "INSERT INTO tenure_jobs (queue, kind, payload, state, max_attempts, due_at, created_at, dedup_key) \
         VALUES ('live', 'a', '', 'waiting', 1, now() + interval '1 hour', now(), 'k')",
    )
    .unwrap();
    let keyed = count(
        &mut conn,
        "SELECT id AS n FROM tenure_jobs WHERE dedup_key = 'k'",
    );
    let snapshot = "SELECT id, state FROM tenure_jobs ORDER BY id";
    #[derive(QueryableByName, PartialEq, Eq, Debug)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
    }
    let before: Vec<Row> = diesel::sql_query(snapshot).load(&mut conn).unwrap();
    let max_before = before.iter().map(|r| r.id).max().unwrap();
    let applied = tenure::run_migrations(&mut conn).unwrap();
    assert_eq!(applied.len(), 1, "{applied:?}");
    let after: Vec<Row> = diesel::sql_query(snapshot).load(&mut conn).unwrap();
    assert_eq!(before, after, "every job, with its id and state");
    assert_eq!(slot_of(&mut conn, keyed), -1);
    let fresh = jobs::enqueue(&mut conn, &NewJob::new("live", "a", vec![]))
        .unwrap()
        .id;
    assert!(fresh > max_before);
    let twin = jobs::enqueue(&mut conn, &NewJob::new("live", "a", vec![]).dedup_key("k")).unwrap();
    assert!(twin.existing && twin.id == keyed, "the key still folds");
    // The running claims still finish (fenced by their tokens), and the rest drain once each.
    let claims: Vec<_> = running.iter().map(|j| j.claim()).collect();
    let done = jobs::complete(&mut conn, &claims).unwrap();
    assert_eq!(done, vec![Outcome::Done; 10]);
    let mut drained = HashSet::new();
    loop {
        let batch = jobs::claim(&mut conn, "live", 50, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        for job in &batch {
            assert!(drained.insert(job.id), "job {} claimed twice", job.id);
        }
        jobs::complete(
            &mut conn,
            &batch.iter().map(|j| j.claim()).collect::<Vec<_>>(),
        )
        .unwrap();
    }
    assert_eq!(
        drained.len(),
        200 + 1 - 20,
        "the waiting jobs due now, each once"
    );
}

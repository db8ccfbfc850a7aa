//! Rotations of the ready ring racing claims (of kinds, of limited jobs), enqueues, cancels
//! and returns: nothing lost or claimed twice; waiting entries moved forward, a backlog too
//! large to move left for claims; the claims' dead entries reclaimed under a held snapshot;
//! a rotation killed before its commit; bad input refused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, JobClaim, NewJob, Outcome};
use tenure::{AnyConnection, Backend, Error};

use super::{NO_WAIT, TTL, assert_ring_exact, claims, spawn_rotator};
use crate::common::{TestDb, conformance, count};

conformance!(
    rotations_racing_claims_lose_and_repeat_nothing,
    rotations_racing_limited_and_kind_claims_and_returns_keep_every_promise,
    waiting_entries_survive_rotations,
    a_backlog_too_large_to_move_waits_for_claims,
    a_rotation_reclaims_dead_entries_under_a_held_snapshot,
    a_rotation_refuses_an_interval_out_of_range,
);

/// 4 claimers, 2 enqueuers (every fourth job due a little later, every tenth cancelled by
/// its enqueuer: at once if still waiting, else asked to) and a rotator that rotates as often
/// as it can, on separate connections: every job is completed exactly once, or cancelled
/// (only those asked), none is left waiting, and (PostgreSQL) the ring ends exact after
/// ten rotations or more.
fn rotations_racing_claims_lose_and_repeat_nothing(backend: Backend) {
    const ENQUEUERS: usize = 2;
    const PER_ENQUEUER: usize = 700;
    const CLAIMERS: usize = 4;
    let db = TestDb::migrated(backend);
    let enqueued_all = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let completions: Arc<Mutex<HashMap<i64, Vec<Outcome>>>> = Arc::default();
    let (rotator, rotations) = spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(5));
    let enqueuers: Vec<_> = (0..ENQUEUERS)
        .map(|e| {
            let mut conn = db.connect();
            std::thread::spawn(move || {
                let (mut kept, mut asked) = (Vec::new(), Vec::new());
                for i in 0..PER_ENQUEUER {
                    let mut job = NewJob::new("race", "work", format!("{e}/{i}").into_bytes());
                    if i % 4 == 1 {
                        job = job.delay(Duration::from_millis(20));
                    }
                    let id = jobs::enqueue(&mut conn, &job)
                        .expect("enqueue must not fail")
                        .id;
                    // A cancel races the claimers: it cancels the waiting job, or asks the
                    // claimed one to cancel (its completion is then answered Cancelled).
                    if i % 10 == 3 && jobs::cancel(&mut conn, id).expect("cancel must not fail") {
                        asked.push(id);
                        continue;
                    }
                    kept.push(id);
                }
                (kept, asked)
            })
        })
        .collect();
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let mut conn = db.connect();
            let (enqueued_all, completions) = (enqueued_all.clone(), completions.clone());
            std::thread::spawn(move || {
                let give_up = Clock::now() + Duration::from_secs(120);
                let mut empty_after_all = 0;
                while Clock::now() < give_up && empty_after_all < 20 {
                    let batch =
                        jobs::claim(&mut conn, "race", 10, TTL).expect("claim must not fail");
                    if batch.is_empty() {
                        if enqueued_all.load(Ordering::SeqCst) {
                            empty_after_all += 1;
                        }
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    let outcomes =
                        jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
                    let mut map = completions.lock().unwrap();
                    for (job, outcome) in batch.iter().zip(outcomes) {
                        assert!(
                            matches!(outcome, Outcome::Done | Outcome::Cancelled),
                            "job {}: {outcome:?}",
                            job.id
                        );
                        map.entry(job.id).or_default().push(outcome);
                    }
                }
            })
        })
        .collect();
    let (mut kept, mut asked) = (Vec::new(), Vec::new());
    for enqueuer in enqueuers {
        let (k, a) = enqueuer.join().unwrap();
        kept.extend(k);
        asked.extend(a);
    }
    enqueued_all.store(true, Ordering::SeqCst);
    for claimer in claimers {
        claimer.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    rotator.join().unwrap();
    let completions = completions.lock().unwrap();
    let twice: Vec<_> = completions.iter().filter(|(_, o)| o.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "{backend}: jobs claimed and finished twice: {twice:?}"
    );
    let missing: Vec<_> = kept
        .iter()
        .filter(|id| completions.get(id) != Some(&vec![Outcome::Done]))
        .collect();
    assert!(
        missing.is_empty(),
        "{backend}: jobs not completed once: {missing:?}"
    );
    let strangers: Vec<_> = completions
        .iter()
        .filter(|(id, o)| o[0] == Outcome::Cancelled && !asked.contains(id))
        .collect();
    assert!(
        strangers.is_empty(),
        "{backend}: cancelled, never asked: {strangers:?}"
    );
    kept.sort_unstable();
    let completed = kept.len();
    let mut conn = db.connect();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'"
        ),
        0
    );
    let rotated = rotations.load(Ordering::SeqCst);
    println!(
        "{backend}: {completed} jobs completed once each, {} cancelled, {rotated} rotations",
        asked.len()
    );
    if backend != Backend::Sqlite {
        assert!(rotated >= 10, "only {rotated} rotations raced the claims");
    }
    assert_ring_exact(&mut conn, backend, "after the race");
}

/// A rotator as fast as it can go beside three claimers (two of kinds `a` and `b`, one of
/// any kind) over 600 jobs of kinds `a`, `b` and `c`, every third limited to two running on
/// key `k`, while each job's first claim gives it back or snoozes it a few milliseconds
/// (one in three each: it waits again, entering the ring while rotations move it), and a
/// canceller cancels every tenth job (at once if it waits, else asks). Each job ends done
/// once (or cancelled, only if asked), never claimed by two claimers at once, never more
/// than two of key `k` running, none left waiting, and (PostgreSQL) the ring ends exact.
fn rotations_racing_limited_and_kind_claims_and_returns_keep_every_promise(backend: Backend) {
    const JOBS: usize = 600;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|i| {
            let job = NewJob::new("lk", ["a", "b", "c"][i % 3], vec![]);
            if i % 3 == 1 { job.limit("k", 2) } else { job }
        })
        .collect();
    let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let (rotator, rotations) = spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(2));
    let canceller = {
        let (mut conn, ids) = (db.connect(), ids.clone());
        std::thread::spawn(move || {
            let mut asked = Vec::new();
            for id in ids.iter().step_by(10) {
                if jobs::cancel(&mut conn, *id).expect("cancel must not fail") {
                    asked.push(*id);
                }
                std::thread::sleep(Duration::from_millis(3));
            }
            asked
        })
    };
    let returned: Arc<Mutex<std::collections::HashSet<i64>>> = Arc::default();
    let holding: Arc<Mutex<std::collections::HashSet<i64>>> = Arc::default();
    let completions: Arc<Mutex<HashMap<i64, Vec<Outcome>>>> = Arc::default();
    let claimers: Vec<_> = (0..3)
        .map(|n| {
            let mut conn = db.connect();
            let (returned, holding, completions) =
                (returned.clone(), holding.clone(), completions.clone());
            std::thread::spawn(move || {
                let give_up = Clock::now() + Duration::from_secs(60);
                let mut empty = 0;
                while Clock::now() < give_up && empty < 30 {
                    let batch = if n < 2 {
                        jobs::claim_kinds(&mut conn, "lk", &["a", "b"], 5, TTL)
                    } else {
                        jobs::claim(&mut conn, "lk", 5, TTL)
                    }
                    .expect("claim must not fail");
                    if batch.is_empty() {
                        empty += 1;
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    empty = 0;
                    for job in &batch {
                        assert!(
                            holding.lock().unwrap().insert(job.id),
                            "job {} claimed while another claimer held it",
                            job.id
                        );
                        if n < 2 {
                            assert_ne!(job.kind, "c", "a claim of kinds a and b took a c");
                        }
                    }
                    let running_k = count(
                        &mut conn,
                        "SELECT COUNT(*) AS n FROM tenure_jobs \
                         WHERE state = 'running' AND limit_key = 'k'",
                    );
                    assert!(running_k <= 2, "{running_k} jobs of key k running");
                    let mut done = Vec::new();
                    for job in &batch {
                        let first = returned.lock().unwrap().insert(job.id);
                        holding.lock().unwrap().remove(&job.id);
                        match (first, job.id % 3) {
                            (true, 0) => {
                                jobs::give_back(&mut conn, &[job.claim()]).unwrap();
                            }
                            (true, 1) => {
                                jobs::snooze(&mut conn, job.claim(), Duration::from_millis(5))
                                    .unwrap();
                            }
                            _ => done.push(job),
                        }
                    }
                    if done.is_empty() {
                        continue;
                    }
                    let finished: Vec<JobClaim> = done.iter().map(|j| j.claim()).collect();
                    let outcomes = jobs::complete(&mut conn, &finished).unwrap();
                    let mut map = completions.lock().unwrap();
                    for (job, outcome) in done.iter().zip(outcomes) {
                        map.entry(job.id).or_default().push(outcome);
                    }
                }
            })
        })
        .collect();
    let asked = canceller.join().unwrap();
    for claimer in claimers {
        claimer.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    rotator.join().unwrap();
    let completions = completions.lock().unwrap();
    for id in &ids {
        let state = jobs::get(&mut conn, *id).unwrap().unwrap().state;
        match completions.get(id).map(Vec::as_slice) {
            Some([Outcome::Done]) => assert_eq!(state, jobs::JobState::Completed, "job {id}"),
            Some([Outcome::Cancelled]) => assert!(asked.contains(id), "job {id}: never asked"),
            None => {
                assert!(asked.contains(id), "job {id} never completed: {state:?}");
                assert_eq!(state, jobs::JobState::Cancelled, "job {id}");
            }
            Some(other) => panic!("job {id}: {other:?}"),
        }
    }
    let rotated = rotations.load(Ordering::SeqCst);
    println!(
        "{backend}: {} jobs done, {} cancelled, {rotated} rotations",
        completions.len(),
        asked.len()
    );
    if backend != Backend::Sqlite {
        assert!(rotated >= 10, "only {rotated} rotations raced the claims");
    }
    assert_ring_exact(&mut conn, backend, "after the race");
}

/// A backlog, jobs due later and a limited job stay claimable through rotations: each moves
/// them forward, never drops them, never copies them twice.
fn waiting_entries_survive_rotations(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let backlog: Vec<NewJob> = (0..1000).map(|_| NewJob::new("q", "a", vec![])).collect();
    jobs::enqueue_many(&mut conn, &backlog).unwrap();
    let later = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "a", vec![]).delay(Duration::from_secs(3600)),
    )
    .unwrap()
    .id;
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).limit("k", 1)).unwrap();
    let mut moved = 0;
    for round in 0..7 {
        if let Some(n) = jobs::rotate_ready(&mut conn, NO_WAIT).unwrap() {
            moved += n;
        }
        assert_ring_exact(&mut conn, backend, &format!("after rotation {round}"));
    }
    if backend != Backend::Sqlite {
        // Each entry moved at least twice (seven rotations, three slots).
        assert!(moved >= 2 * 1002, "only {moved} entries moved");
    }
    let mut claimed = 0;
    loop {
        let batch = jobs::claim(&mut conn, "q", 100, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        claimed += batch.len();
        assert!(
            batch.iter().all(|j| j.id != later),
            "the job due later was claimed"
        );
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    assert_eq!(claimed, 1001, "the backlog and the limited job, each once");
    assert_ring_exact(&mut conn, backend, "after the drain");
}

/// The servers: a rotation never moves more than 2,000 waiting entries at once (claims wait
/// behind its lock while it does): it leaves a larger backlog in its slot, moves the
/// ring no further, and moves the rest once claims have taken enough; nothing is lost.
fn a_backlog_too_large_to_move_waits_for_claims(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let backlog: Vec<NewJob> = (0..3_000)
        .map(|_| NewJob::new("big", "a", vec![]))
        .collect();
    jobs::enqueue_many(&mut conn, &backlog).unwrap();
    // The two empty slots are emptied; then the backlog's slot is the oldest.
    let rotations: Vec<Option<u64>> = (0..3)
        .map(|_| jobs::rotate_ready(&mut conn, NO_WAIT).unwrap())
        .collect();
    if backend != Backend::Sqlite {
        assert_eq!(
            rotations,
            vec![Some(0), Some(0), None],
            "3,000 entries are not moved"
        );
        assert_eq!(
            jobs::rotate_ready(&mut conn, NO_WAIT).unwrap(),
            None,
            "nor later"
        );
    }
    assert_ring_exact(&mut conn, backend, "with the backlog left in its slot");
    let mut taken = 0;
    while taken < 1_500 {
        let batch = jobs::claim(&mut conn, "big", 500, TTL).unwrap();
        taken += batch.len();
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
    }
    if backend != Backend::Sqlite {
        assert_eq!(jobs::rotate_ready(&mut conn, NO_WAIT).unwrap(), Some(1_500));
    }
    assert_ring_exact(&mut conn, backend, "after the rest moved");
}

/// The servers: with a snapshot held open on another connection (vacuum or purge may
/// remove nothing claimed since), 3,000 jobs enqueued, claimed and completed leave dead entries in the
/// ring, and three rotations remove them all: every slot is emptied to no pages, the one
/// still waiting job's entry kept. (Without the ring, `tenure_jobs`' claim index kept every
/// claimed job's entry until the snapshot ended.)
fn a_rotation_reclaims_dead_entries_under_a_held_snapshot(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut holder = db.connect();
    let begin = match backend {
        Backend::Postgres => {
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT COUNT(*) FROM tenure_leases"
        }
        Backend::Mysql => {
            "START TRANSACTION WITH CONSISTENT SNAPSHOT; SELECT COUNT(*) FROM tenure_leases"
        }
        Backend::Sqlite => "BEGIN; SELECT COUNT(*) FROM tenure_leases",
    };
    holder.batch_execute(begin).unwrap();
    let batch: Vec<NewJob> = (0..3000).map(|_| NewJob::new("q", "a", vec![])).collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    loop {
        let claimed = jobs::claim(&mut conn, "q", 100, TTL).unwrap();
        if claimed.is_empty() {
            break;
        }
        jobs::complete(&mut conn, &claims(&claimed)).unwrap();
    }
    let keep = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "a", vec![]).delay(Duration::from_secs(600)),
    )
    .unwrap()
    .id;
    // The ring's pages: PostgreSQL's heaps; MariaDB's partitions (data and indexes, as its
    // statistics count them once analyzed).
    let pages = |conn: &mut AnyConnection| match backend {
        Backend::Postgres => Some(count(
            conn,
            "SELECT (pg_relation_size('tenure_ready_0') + pg_relation_size('tenure_ready_1') \
             + pg_relation_size('tenure_ready_2'))::bigint / 8192 AS n",
        )),
        Backend::Mysql => {
            conn.batch_execute("ANALYZE TABLE tenure_ready").unwrap();
            Some(count(
                conn,
                "SELECT CAST(SUM(data_length + index_length) / 16384 AS SIGNED) AS n \
                 FROM information_schema.partitions \
                 WHERE table_schema = DATABASE() AND table_name = 'tenure_ready'",
            ))
        }
        Backend::Sqlite => None,
    };
    if let Some(before) = pages(&mut conn) {
        assert!(before >= 10, "3,000 dead entries take pages: {before}");
        let mut rotated = 0;
        while rotated < 3 {
            if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
                rotated += 1;
            }
        }
        let after = pages(&mut conn).unwrap_or_default();
        // PostgreSQL: the one entry's page; MariaDB: each partition's four indexes' roots
        // (the primary key, the two claim indexes, the tenants' turns).
        let bound = if backend == Backend::Postgres { 1 } else { 12 };
        assert!(
            after <= bound,
            "the ring kept {after} pages (had {before}) under the held snapshot"
        );
        println!("{backend}: the ring's pages {before} -> {after} under a held snapshot");
    }
    assert_ring_exact(&mut conn, backend, "after the rotations");
    assert_eq!(
        jobs::get(&mut conn, keep).unwrap().unwrap().state,
        jobs::JobState::Waiting
    );
    holder.batch_execute("ROLLBACK").unwrap();
}

/// A rotation's interval longer than [`tenure::MAX_TTL`] (as a time to live or a delay is)
/// is [`Error::InvalidInput`] on every backend, before any statement. (Before: one the
/// database could not add to its clock failed on PostgreSQL in SQL, "interval out of
/// range", a database error, and SQLite and MySQL/MariaDB accepted it.)
fn a_rotation_refuses_an_interval_out_of_range(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for interval in [
        Duration::from_micros(i64::MAX as u64),
        tenure::MAX_TTL + Duration::from_secs(1),
    ] {
        let result = jobs::rotate_ready(&mut conn, interval);
        assert!(
            matches!(result, Err(Error::InvalidInput { .. })),
            "{backend}: {interval:?}: {result:?}"
        );
    }
    // The longest accepted interval works: not due.
    assert_eq!(
        jobs::rotate_ready(&mut conn, tenure::MAX_TTL).unwrap(),
        None,
        "{backend}"
    );
}

/// PostgreSQL: a rotation whose connection is killed before its commit (a worker's process
/// killed mid-rotation) rolls back, all but the generation's sequence, which `setval` moves
/// outside the transaction: the sequence is then one generation ahead of the ring's row, and
/// new entries go to the slot the next rotation empties. That rotation must move them (one
/// of them written by a transaction still open when it is first tried: it gives up, not
/// waits), every later one too: the ring stays exact, and each job is claimed once.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_rotation_killed_before_its_commit_loses_nothing() {
    let backend = Backend::Postgres;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = vec![
        jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
            .unwrap()
            .id,
    ];
    let mut doomed = db.connect();
    let pid = count(&mut doomed, "SELECT pg_backend_pid()::bigint AS n");
    doomed
        .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED; SELECT tenure_rotate_ready(0)")
        .unwrap();
    diesel::sql_query(format!("SELECT pg_terminate_backend({pid})"))
        .execute(&mut conn)
        .unwrap();
    drop(doomed);
    let ahead = count(
        &mut conn,
        "SELECT (SELECT last_value FROM tenure_ready_generation) \
         - (SELECT generation FROM tenure_ready_ring) AS n",
    );
    println!("the sequence is {ahead} generation(s) ahead of the ring after the kill");
    assert_ring_exact(&mut conn, backend, "after the killed rotation");
    ids.push(
        jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
            .unwrap()
            .id,
    );
    let mut writer = db.connect();
    let open = writer
        .transaction::<_, Error, _>(|w| {
            let id = jobs::enqueue(w, &NewJob::new("q", "a", vec![]))?.id;
            // The next rotation would empty the slot this entry is in.
            assert_eq!(jobs::rotate_ready(&mut conn, NO_WAIT).unwrap(), None);
            Ok(id)
        })
        .unwrap();
    ids.push(open);
    for round in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
        assert_ring_exact(&mut conn, backend, &format!("after rotation {round}"));
    }
    assert_eq!(super::drain(&mut conn), ids, "each job once");
}

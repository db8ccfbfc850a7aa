//! The ready ring (PostgreSQL's storage for what claims read, docs/storage-design.md): it
//! lists exactly the waiting jobs whatever changed them, its rotations lose and duplicate
//! nothing while claims, enqueues and cancels race them, entries still waiting survive any
//! number of rotations, and a rotation reclaims the claims' dead entries while another
//! transaction holds a snapshot open (vacuum could not). On SQLite and MySQL/MariaDB, which
//! claim from `tenure_jobs`, a rotation does nothing and the same races hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, JobClaim, NewJob, OnDuplicate, Outcome, Retry};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, conformance, count};

conformance!(
    the_ring_lists_exactly_the_waiting_jobs,
    rotations_racing_claims_lose_and_repeat_nothing,
    waiting_entries_survive_rotations,
    a_rotation_reclaims_dead_entries_under_a_held_snapshot,
    a_repeatable_read_cancel_after_rotations_leaves_no_entry,
    a_repeatable_read_replace_after_rotations_leaves_one_entry,
    a_rotation_refuses_an_interval_out_of_range,
    a_callers_open_transaction_across_rotations_loses_nothing,
    rotations_racing_limited_and_kind_claims_and_returns_keep_every_promise,
    the_ring_follows_parked_jobs_workflows_schedules_and_bulk_retries,
    replacing_duplicates_racing_rotations_and_claims_never_run_a_job_early,
);

const TTL: Duration = Duration::from_secs(60);
const NO_WAIT: Duration = Duration::ZERO;

fn claims(jobs: &[jobs::ClaimedJob]) -> Vec<JobClaim> {
    jobs.iter().map(|j| j.claim()).collect()
}

#[derive(QueryableByName, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    queue: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    kind: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    priority: i32,
    #[diesel(sql_type = diesel::sql_types::Text)]
    due: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    limit_key: Option<String>,
}

/// PostgreSQL: the ring's entries and the waiting jobs agree, one entry per waiting job with
/// its claim columns; elsewhere there is no ring and a rotation does nothing.
fn assert_ring_exact(conn: &mut AnyConnection, backend: Backend, context: &str) {
    if backend != Backend::Postgres {
        assert_eq!(
            jobs::rotate_ready(conn, NO_WAIT).unwrap(),
            None,
            "{context}"
        );
        return;
    }
    let read = |conn: &mut AnyConnection, table: &str, filter: &str| -> Vec<Entry> {
        let sql = format!(
            "SELECT id, queue, kind, priority, due_at::text AS due, limit_key FROM {table} \
             {filter} ORDER BY id"
        );
        diesel::sql_query(&sql)
            .load(conn)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    };
    let ring = read(conn, "tenure_ready", "");
    let waiting = read(conn, "tenure_jobs", "WHERE state = 'waiting'");
    assert_eq!(
        ring, waiting,
        "{context}: the ring differs from the waiting jobs"
    );
}

/// Every way a job starts or stops waiting, or changes what a claim reads of it while it
/// waits: the ring follows each, on its own and in bulk.
fn the_ring_lists_exactly_the_waiting_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let check = |conn: &mut AnyConnection, what: &str| assert_ring_exact(conn, backend, what);
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![1])).unwrap();
    let later = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "b", vec![]).delay(Duration::from_secs(600)),
    )
    .unwrap()
    .id;
    check(&mut conn, "after single enqueues");
    let bulk: Vec<NewJob> = (0..300)
        .map(|i| NewJob::new("q", if i % 2 == 0 { "a" } else { "b" }, vec![]).priority(i % 5))
        .collect();
    jobs::enqueue_many(&mut conn, &bulk).unwrap();
    check(&mut conn, "after a bulk enqueue");
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).limit("k", 2)).unwrap();
    check(&mut conn, "after a limited enqueue");
    // A duplicate that replaces the waiting job's payload and due time.
    let dedup = NewJob::new("q", "a", vec![])
        .dedup_key("d")
        .delay(Duration::from_secs(60));
    jobs::enqueue(&mut conn, &dedup).unwrap();
    let replace = NewJob::new("q", "a", vec![9])
        .dedup_key("d")
        .on_duplicate(OnDuplicate::Replace);
    jobs::enqueue(&mut conn, &replace).unwrap();
    check(&mut conn, "after a duplicate replaced a waiting job");
    let claimed = jobs::claim(&mut conn, "q", 40, TTL).unwrap();
    check(&mut conn, "after a claim");
    let (done, rest) = claimed.split_at(10);
    jobs::complete(&mut conn, &claims(done)).unwrap();
    let (failed, rest) = rest.split_at(10);
    for job in failed {
        jobs::fail(
            &mut conn,
            job.claim(),
            "again",
            Retry::After(Duration::from_secs(5)),
        )
        .unwrap();
    }
    check(&mut conn, "after retries");
    let (snoozed, rest) = rest.split_at(10);
    for job in snoozed {
        jobs::snooze(&mut conn, job.claim(), Duration::from_secs(30)).unwrap();
    }
    let (given_back, rest) = rest.split_at(5);
    jobs::give_back(&mut conn, &claims(given_back)).unwrap();
    check(&mut conn, "after snoozes and give-backs");
    for job in rest {
        jobs::fail(&mut conn, job.claim(), "dead", Retry::Never).unwrap();
    }
    jobs::retry_dead(&mut conn, rest[0].id).unwrap();
    check(&mut conn, "after dead jobs and a retry of one");
    assert!(jobs::cancel(&mut conn, later).unwrap());
    let fresh = jobs::enqueue(&mut conn, &NewJob::new("q", "c", vec![]))
        .unwrap()
        .id;
    assert!(jobs::cancel(&mut conn, fresh).unwrap());
    check(&mut conn, "after cancels");
    // A workflow's dependent: blocked (not in the ring) until its dependency completes.
    let first = jobs::enqueue(&mut conn, &NewJob::new("w", "a", vec![]))
        .unwrap()
        .id;
    let then = jobs::enqueue(
        &mut conn,
        &NewJob::new("w", "a", vec![]).depends_on([first]),
    )
    .unwrap()
    .id;
    check(&mut conn, "with a blocked dependent");
    let taken = jobs::claim(&mut conn, "w", 1, TTL).unwrap();
    assert_eq!(taken[0].id, first);
    jobs::complete(&mut conn, &claims(&taken)).unwrap();
    check(&mut conn, "after the dependency completed");
    assert_eq!(jobs::claim(&mut conn, "w", 1, TTL).unwrap()[0].id, then);
    // A lapsed claim rescued: waiting again.
    let lapsing = jobs::enqueue(&mut conn, &NewJob::new("r", "a", vec![]))
        .unwrap()
        .id;
    jobs::claim(&mut conn, "r", 1, Duration::from_millis(1)).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let rescued = jobs::rescue(&mut conn, 10).unwrap();
    assert!(rescued.requeued.contains(&lapsing), "{rescued:?}");
    check(&mut conn, "after a rescue");
    // Rotations in between change none of it.
    for _ in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    check(&mut conn, "after rotations");
    // A waiting job deleted by hand leaves the ring too.
    let doomed = jobs::enqueue(&mut conn, &NewJob::new("q", "d", vec![]))
        .unwrap()
        .id;
    diesel::sql_query(format!("DELETE FROM tenure_jobs WHERE id = {doomed}"))
        .execute(&mut conn)
        .unwrap();
    check(&mut conn, "after a delete");
}

/// 4 claimers, 2 enqueuers (every fourth job due a little later, every tenth cancelled by
/// its enqueuer: at once if still waiting, else asked to) and a rotator that rotates as often
/// as it can, on separate connections: every job is completed exactly once, or cancelled
/// (only those asked), none is left waiting, and (PostgreSQL) the ring ends exact after
/// dozens of rotations.
fn rotations_racing_claims_lose_and_repeat_nothing(backend: Backend) {
    const ENQUEUERS: usize = 2;
    const PER_ENQUEUER: usize = 1500;
    const CLAIMERS: usize = 4;
    let db = TestDb::migrated(backend);
    let enqueued_all = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let completions: Arc<Mutex<HashMap<i64, Vec<Outcome>>>> = Arc::default();
    let rotations = Arc::new(AtomicUsize::new(0));
    let rotator = {
        let (mut conn, stop, rotations) = (db.connect(), stop.clone(), rotations.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if jobs::rotate_ready(&mut conn, NO_WAIT)
                    .expect("a rotation must not fail")
                    .is_some()
                {
                    rotations.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
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
    if backend == Backend::Postgres {
        assert!(rotated >= 20, "only {rotated} rotations raced the claims");
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
    if backend == Backend::Postgres {
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

/// PostgreSQL: with a snapshot held open on another connection (vacuum may remove nothing
/// claimed since), 3,000 jobs enqueued, claimed and completed leave dead entries in the
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
    if backend == Backend::Postgres {
        let pages = |conn: &mut AnyConnection| {
            count(
                conn,
                "SELECT (pg_relation_size('tenure_ready_0') + pg_relation_size('tenure_ready_1') \
                 + pg_relation_size('tenure_ready_2'))::bigint / 8192 AS n",
            )
        };
        let before = pages(&mut conn);
        assert!(before >= 10, "3,000 dead entries take pages: {before}");
        let mut rotated = 0;
        while rotated < 3 {
            if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
                rotated += 1;
            }
        }
        let after = pages(&mut conn);
        assert!(
            after <= 1,
            "the ring kept {after} pages (had {before}) under the held snapshot"
        );
        println!("{backend}: the ring's heap {before} pages -> {after} under a held snapshot");
    }
    assert_ring_exact(&mut conn, backend, "after the rotations");
    assert_eq!(
        jobs::get(&mut conn, keep).unwrap().unwrap().state,
        jobs::JobState::Waiting
    );
    holder.batch_execute("ROLLBACK").unwrap();
}

/// PostgreSQL: a live database migrated to the ring keeps every job, and the ring lists its
/// waiting ones exactly: jobs in every state are written under the layout before it (the
/// ring's migration reverted by its own `down.sql`), then the migration runs again.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_live_database_migrates_into_the_ring() {
    let backend = Backend::Postgres;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute(include_str!(
        "../../migrations/postgres/tenure-0045_ready_ring/down.sql"
    ))
    .unwrap();
    let removed =
        diesel::sql_query("DELETE FROM __diesel_schema_migrations WHERE version LIKE '%0045%'")
            .execute(&mut conn)
            .unwrap();
    assert_eq!(removed, 1, "the ring's migration is on record once");
    let bulk: Vec<NewJob> = (0..500)
        .map(|i| NewJob::new("live", "a", vec![]).priority(i % 3))
        .collect();
    jobs::enqueue_many(&mut conn, &bulk).unwrap();
    jobs::enqueue(
        &mut conn,
        &NewJob::new("live", "a", vec![]).delay(Duration::from_secs(600)),
    )
    .unwrap();
    // Jobs in other states, written as the layout before the ring left them (its claim
    // cannot run here: this build's claim reads the ring).
    conn.batch_execute(
        "UPDATE tenure_jobs SET state = 'completed', finished_at = now() WHERE id % 10 = 1; \
         UPDATE tenure_jobs SET state = 'dead', finished_at = now() WHERE id % 10 = 2; \
         UPDATE tenure_jobs SET due_at = now() + interval '1 minute' WHERE id % 10 = 3",
    )
    .unwrap();
    let waiting_before = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'",
    );
    let all_before = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs");
    let applied = tenure::run_migrations(&mut conn).unwrap();
    assert_eq!(applied.len(), 1, "{applied:?}");
    assert_ring_exact(&mut conn, backend, "after migrating a live database");
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_ready"),
        waiting_before
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        all_before
    );
    // The waiting jobs due now drain once each.
    let mut drained = 0;
    loop {
        let batch = jobs::claim(&mut conn, "live", 100, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        drained += batch.len();
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
    }
    assert_eq!(drained, 350, "the waiting jobs due now, each once");
}

/// A caller's transaction at REPEATABLE READ on `caller` (MySQL's default isolation; a
/// choice on PostgreSQL) reads first (its snapshot starts there), then rotations on `conn`
/// move every entry of the ring (three of them: each slot emptied once), then `change` runs
/// in the caller's transaction. The entries the rotations wrote are newer than the caller's
/// snapshot, and the slots they left were truncated: a statement under that snapshot sees
/// no entry for a waiting job. Returns the change's outcome (the transaction committed if
/// it is `Ok`).
fn after_rotations_in_repeatable_read<T>(
    backend: Backend,
    conn: &mut AnyConnection,
    caller: &mut AnyConnection,
    id: i64,
    change: impl FnOnce(&mut AnyConnection) -> tenure::Result<T>,
) -> tenure::Result<T> {
    match backend {
        Backend::Postgres => caller.batch_execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        ),
        Backend::Mysql => {
            caller.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        }
        Backend::Sqlite => Ok(()),
    }
    .unwrap();
    caller.transaction::<_, Error, _>(|c| {
        assert_eq!(jobs::get(c, id)?.unwrap().state, jobs::JobState::Waiting);
        let mut rotated = 0;
        for _ in 0..1000 {
            if jobs::rotate_ready(conn, NO_WAIT).unwrap().is_some() {
                rotated += 1;
                if rotated == 3 {
                    break;
                }
            }
        }
        if backend == Backend::Postgres {
            assert_eq!(rotated, 3, "rotations under the caller's snapshot");
        }
        change(c)
    })
}

/// A cancel in a caller's REPEATABLE READ transaction, after rotations moved the waiting
/// job's entry past the caller's snapshot: either it fails with a serialization error
/// (nothing changed, the job still waits and is claimable) or the cancelled job has no entry
/// left and no claim ever takes it. (Before: the trigger's delete, under the caller's
/// snapshot, found no entry and deleted nothing; the cancel committed and the next claim
/// took the cancelled job and ran it.)
fn a_repeatable_read_cancel_after_rotations_leaves_no_entry(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let doomed = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let outcome =
        after_rotations_in_repeatable_read(backend, &mut conn, &mut caller, doomed, |c| {
            jobs::cancel(c, doomed)
        });
    let state = jobs::get(&mut conn, doomed).unwrap().unwrap().state;
    match outcome {
        Ok(cancelled) => {
            assert!(cancelled, "{backend}: the waiting job was not cancelled");
            assert_eq!(state, jobs::JobState::Cancelled);
        }
        Err(e) => {
            assert!(
                e.is_retryable(),
                "{backend}: not a serialization error: {e}"
            );
            assert_eq!(state, jobs::JobState::Waiting);
        }
    }
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    if state == jobs::JobState::Cancelled {
        assert!(
            taken.is_empty(),
            "{backend}: a cancelled job was claimed: {taken:?}"
        );
    } else {
        assert_eq!(taken, vec![doomed], "{backend}: the job still waiting");
    }
    assert_ring_exact(&mut conn, backend, "after a cancel at REPEATABLE READ");
}

/// A replacing duplicate (a later due time) in a caller's REPEATABLE READ transaction, after
/// rotations moved the waiting job's entry past the caller's snapshot: either it fails with
/// a serialization error (the job unchanged) or the job keeps one entry, with its new due
/// time, and no claim takes it before then. (Before: the old entry stayed beside the new
/// one, and a claim took the job at once, ten minutes early.)
fn a_repeatable_read_replace_after_rotations_leaves_one_entry(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let job = NewJob::new("q", "a", vec![]).dedup_key("d");
    let id = jobs::enqueue(&mut conn, &job).unwrap().id;
    let later = job
        .clone()
        .delay(Duration::from_secs(600))
        .on_duplicate(OnDuplicate::Replace);
    let outcome = after_rotations_in_repeatable_read(backend, &mut conn, &mut caller, id, |c| {
        jobs::enqueue(c, &later)
    });
    let replaced = match outcome {
        Ok(enqueued) => {
            assert_eq!(enqueued.id, id);
            assert!(
                enqueued.updated,
                "{backend}: the waiting job was not replaced"
            );
            true
        }
        Err(e) => {
            assert!(
                e.is_retryable(),
                "{backend}: not a serialization error: {e}"
            );
            false
        }
    };
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    if replaced {
        assert!(
            taken.is_empty(),
            "{backend}: the job due in ten minutes was claimed now: {taken:?}"
        );
    } else {
        assert_eq!(taken, vec![id], "{backend}: the job unchanged, due now");
    }
    assert_ring_exact(&mut conn, backend, "after a replace at REPEATABLE READ");
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

/// PostgreSQL: the rotation's function called in a REPEATABLE READ transaction (by hand:
/// [`jobs::rotate_ready`] begins READ COMMITTED) whose snapshot began before an enqueue
/// into the oldest slot committed: the rotation must not truncate the entry it cannot see.
/// The enqueue's transaction stays open across two rotations (they leave its slot alone),
/// the rotating transaction's snapshot begins, the enqueue commits, then the third rotation
/// would empty that slot. (Before: its copy, under the old snapshot, missed the new entry
/// and the truncate removed it: a waiting job no claim could ever find.)
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_rotation_under_an_old_snapshot_loses_no_entry() {
    let backend = Backend::Postgres;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut rotator = db.connect();
    let mut writer = db.connect();
    let id = writer
        .transaction::<_, Error, _>(|w| {
            let id = jobs::enqueue(w, &NewJob::new("q", "a", vec![]))?.id;
            let mut rotated = 0;
            for _ in 0..1000 {
                if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
                    rotated += 1;
                    if rotated == 2 {
                        break;
                    }
                }
            }
            assert_eq!(rotated, 2, "rotations beside the open enqueue");
            rotator
                .batch_execute(
                    "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT COUNT(*) FROM tenure_leases",
                )
                .unwrap();
            Ok(id)
        })
        .unwrap();
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let outcome =
        diesel::sql_query("SELECT tenure_rotate_ready(0) AS n").get_result::<N>(&mut rotator);
    match &outcome {
        Ok(N { n }) => println!("the rotation under the old snapshot moved {n}"),
        Err(e) => println!("the rotation under the old snapshot refused: {e}"),
    }
    rotator
        .batch_execute(if outcome.is_ok() {
            "COMMIT"
        } else {
            "ROLLBACK"
        })
        .unwrap();
    assert_ring_exact(&mut conn, backend, "after a rotation under an old snapshot");
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(taken, vec![id], "the waiting job, claimable");
}

/// A caller's READ COMMITTED transaction enqueues (a plain job and a limited one), cancels a
/// waiting job and replaces another's due time, and stays open while rotations are tried on
/// another connection (on PostgreSQL, after the enqueues, the two that leave the slot of its
/// entries alone run, and the one that would empty it gives up, not waits; after the cancel
/// none runs: its delete holds every slot) and, on PostgreSQL, a claim runs (it must neither wait for the
/// caller nor take the jobs it holds). After the commit, more rotations: the ring is exact,
/// and a drain claims exactly the waiting jobs, once each. (It fails if a rotation or a
/// claim waited for the caller: the test hangs and is stopped; if a rotation truncated an
/// uncommitted entry, or a claim took the cancelled or the replaced job.)
fn a_callers_open_transaction_across_rotations_loses_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let enqueue = |conn: &mut AnyConnection, job: NewJob| jobs::enqueue(conn, &job).unwrap().id;
    let doomed = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let keyed = NewJob::new("q", "a", vec![]).dedup_key("d");
    let replaced = enqueue(&mut conn, keyed.clone());
    let free = enqueue(&mut conn, NewJob::new("q", "b", vec![]).priority(-1));
    let (plain, limited) = caller
        .transaction::<_, Error, _>(|c| {
            let plain = jobs::enqueue(c, &NewJob::new("q", "a", vec![]))?.id;
            let limited = jobs::enqueue(c, &NewJob::new("q", "b", vec![]).limit("k", 1))?.id;
            // Its new entries hold one slot: the two rotations that leave it alone run, the
            // third, which would empty it, gives up.
            let mut rotated = 0;
            for _ in 0..12 {
                if jobs::rotate_ready(&mut conn, NO_WAIT).unwrap().is_some() {
                    rotated += 1;
                }
            }
            if backend == Backend::Postgres {
                assert_eq!(rotated, 2, "rotations beside the open enqueues");
            }
            assert!(jobs::cancel(c, doomed)?);
            let later = keyed
                .clone()
                .delay(Duration::from_secs(600))
                .on_duplicate(OnDuplicate::Replace);
            assert!(jobs::enqueue(c, &later)?.updated);
            // Its deletes of entries hold every slot: no rotation now, none waits.
            for _ in 0..6 {
                assert_eq!(jobs::rotate_ready(&mut conn, NO_WAIT).unwrap(), None);
            }
            if backend == Backend::Postgres {
                let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
                    .unwrap()
                    .iter()
                    .map(|j| j.id)
                    .collect();
                assert_eq!(taken, vec![free], "only the job the caller does not hold");
            }
            Ok((plain, limited))
        })
        .unwrap();
    for _ in 0..6 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    assert_ring_exact(&mut conn, backend, "after the caller committed");
    let mut taken = Vec::new();
    loop {
        let batch = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        taken.extend(batch.iter().map(|j| j.id));
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    taken.sort_unstable();
    let mut expected = vec![plain, limited];
    if backend != Backend::Postgres {
        expected.push(free);
    }
    expected.sort_unstable();
    assert_eq!(
        taken, expected,
        "{backend}: the jobs due now, once each (not the cancelled {doomed}, not the replaced {replaced})"
    );
    assert_ring_exact(&mut conn, backend, "after the drain");
    assert_eq!(
        jobs::get(&mut conn, replaced).unwrap().unwrap().state,
        jobs::JobState::Waiting
    );
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
    let rotations = Arc::new(AtomicUsize::new(0));
    let rotator = {
        let (mut conn, stop, rotations) = (db.connect(), stop.clone(), rotations.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if jobs::rotate_ready(&mut conn, NO_WAIT)
                    .expect("a rotation must not fail")
                    .is_some()
                {
                    rotations.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
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
    if backend == Backend::Postgres {
        assert!(rotated >= 10, "only {rotated} rotations raced the claims");
    }
    assert_ring_exact(&mut conn, backend, "after the race");
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
    let mut taken = Vec::new();
    loop {
        let batch = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        taken.extend(batch.iter().map(|j| j.id));
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
    }
    taken.sort_unstable();
    assert_eq!(taken, ids, "each job once");
}

/// The paths the first exactness test leaves out, each followed by a rotation and a check:
/// parked jobs (enqueued parked, resumed, failed into a retry, completed, expired),
/// workflows (enqueued blocked, cancelled with their callbacks; a step dead, its dependents
/// settled and its callback released; the dead step retried by kind), a schedule's tick
/// (keyed enqueues), then a drain: every waiting job claimed once, the ring empty of them.
fn the_ring_follows_parked_jobs_workflows_schedules_and_bulk_retries(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let check = |conn: &mut AnyConnection, what: &str| {
        jobs::rotate_ready(conn, NO_WAIT).unwrap();
        assert_ring_exact(conn, backend, what);
    };
    let hour = Duration::from_secs(3600);
    let parked: Vec<_> = (0..4)
        .map(|i| {
            let deadline = if i == 3 { Duration::ZERO } else { hour };
            jobs::enqueue_parked(&mut conn, &NewJob::new("p", "a", vec![]), deadline).unwrap()
        })
        .collect();
    check(&mut conn, "after parked enqueues");
    jobs::resume_parked(&mut conn, &parked[0].token, None).unwrap();
    check(&mut conn, "after a resume");
    jobs::fail_parked(&mut conn, &parked[1].token, "declined").unwrap();
    check(&mut conn, "after a parked job failed into a retry");
    jobs::complete_parked(&mut conn, &parked[2].token, None).unwrap();
    check(&mut conn, "after a parked job completed");
    assert_eq!(
        jobs::expire_parked(&mut conn, 10).unwrap(),
        vec![parked[3].id]
    );
    check(&mut conn, "after a parked job expired");
    let workflow = |name: &str| {
        let mut w = jobs::Workflow::new(name);
        let first = w.add(NewJob::new(name, "a", vec![]));
        w.add(NewJob::new(name, "a", vec![]));
        w.add_after(&[first], NewJob::new(name, "b", vec![]));
        w.on_finish(NewJob::new(name, "c", vec![]));
        w
    };
    let cancelled = jobs::enqueue_workflow(&mut conn, &workflow("w1")).unwrap();
    check(&mut conn, "after a workflow enqueued");
    assert!(jobs::cancel_workflow(&mut conn, cancelled.id).unwrap() > 0);
    check(&mut conn, "after a workflow cancelled");
    jobs::enqueue_workflow(&mut conn, &workflow("w2")).unwrap();
    for job in jobs::claim_kinds(&mut conn, "w2", &["a"], 10, TTL).unwrap() {
        jobs::fail(&mut conn, job.claim(), "dead", Retry::Never).unwrap();
    }
    check(&mut conn, "after a workflow's steps died");
    assert_eq!(jobs::retry_dead_of_kind(&mut conn, "w2", "a").unwrap(), 2);
    check(&mut conn, "after the dead steps retried by kind");
    tenure::schedules::upsert(
        &mut conn,
        &tenure::schedules::Schedule::every(
            "s",
            Duration::from_secs(1),
            NewJob::new("s", "a", vec![]),
        ),
    )
    .unwrap();
    tenure::schedules::tick(&mut conn).unwrap();
    check(&mut conn, "after a schedule's tick");
    let mut claimed: HashMap<i64, usize> = HashMap::new();
    for queue in ["p", "w1", "w2", "s"] {
        loop {
            let batch = jobs::claim(&mut conn, queue, 10, TTL).unwrap();
            if batch.is_empty() {
                break;
            }
            for job in &batch {
                *claimed.entry(job.id).or_default() += 1;
            }
            jobs::complete(&mut conn, &claims(&batch)).unwrap();
            check(&mut conn, &format!("while draining {queue}"));
        }
    }
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{backend}: claimed twice: {twice:?}");
    let left: Vec<Entry> = diesel::sql_query(
        "SELECT id, queue, kind, priority, '' AS due, limit_key FROM tenure_jobs \
         WHERE state = 'waiting' ORDER BY id",
    )
    .load(&mut conn)
    .unwrap();
    println!("{backend}: left waiting {left:?}");
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting' \
                 AND id NOT IN ({}, {})",
                parked[1].id, parked[3].id
            )
        ),
        0,
        "{backend}: a job left waiting (but the failed and the expired parked ones, in their backoff)"
    );
}

/// Replacing duplicates (OnDuplicate::Replace and KeepEarlierDue, each moving a waiting job's
/// due time to now or ten minutes on) race a rotator and two claimers on 20 keys: no job is
/// ever claimed before the due time it has when claimed (an entry left with an old due time
/// would be), none twice at once, and the ring ends exact.
fn replacing_duplicates_racing_rotations_and_claims_never_run_a_job_early(backend: Backend) {
    let db = TestDb::migrated(backend);
    let stop = Arc::new(AtomicBool::new(false));
    let rotator = {
        let (mut conn, stop) = (db.connect(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                jobs::rotate_ready(&mut conn, NO_WAIT).expect("a rotation must not fail");
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let replacer = {
        let mut conn = db.connect();
        std::thread::spawn(move || {
            for i in 0..400u32 {
                let delay = if i % 3 == 0 {
                    Duration::ZERO
                } else {
                    Duration::from_secs(600)
                };
                let mode = if i % 5 == 0 {
                    OnDuplicate::KeepEarlierDue
                } else {
                    OnDuplicate::Replace
                };
                let job = NewJob::new("rd", "a", vec![])
                    .dedup_key(format!("k{}", i % 20))
                    .delay(delay)
                    .on_duplicate(mode);
                jobs::enqueue(&mut conn, &job).expect("enqueue must not fail");
            }
        })
    };
    let claimers: Vec<_> = (0..2)
        .map(|_| {
            let (mut conn, stop) = (db.connect(), stop.clone());
            std::thread::spawn(move || {
                let mut taken = 0;
                while !stop.load(Ordering::SeqCst) {
                    let batch = jobs::claim(&mut conn, "rd", 5, TTL).expect("claim must not fail");
                    for job in &batch {
                        assert!(
                            job.due_at <= job.claimed_at,
                            "job {} claimed at {} before its due time {}",
                            job.id,
                            job.claimed_at,
                            job.due_at
                        );
                    }
                    taken += batch.len();
                    if !batch.is_empty() {
                        jobs::complete(&mut conn, &claims(&batch)).expect("complete must not fail");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                taken
            })
        })
        .collect();
    replacer.join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::SeqCst);
    let taken: usize = claimers.into_iter().map(|c| c.join().unwrap()).sum();
    rotator.join().unwrap();
    let mut conn = db.connect();
    println!("{backend}: {taken} jobs claimed");
    assert_ring_exact(&mut conn, backend, "after the replacing duplicates");
}

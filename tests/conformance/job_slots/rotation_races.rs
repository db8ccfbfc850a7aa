//! Races on PostgreSQL's job slots (tenure-0056): rotations racing bulk enqueues by COPY and
//! callers' open transactions, keyed jobs by every path, a killed rotation, an application
//! user that had its privileges before the migration, and a rotation's backoff while a report
//! holds the slots.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, Finished, NewJob, Retention, Retry};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count, server_url};

use super::{drain, rotate};

const TTL: Duration = Duration::from_secs(60);

/// COPY bulk enqueues (>= 64 rows), multi-row INSERTs, and callers' own open transactions
/// (tenure::transaction, raw READ COMMITTED and REPEATABLE READ BEGINs) that enqueue and stay
/// open while a rotator and a pruner turn the slots as fast as they can: every job enqueued
/// is claimed exactly once.
#[test]
fn postgres_copy_bulks_and_open_transactions_racing_rotations_lose_nothing() {
    let db = TestDb::migrated(Backend::Postgres);
    let done = Arc::new(AtomicBool::new(false));
    let enqueued = Arc::new(Mutex::new(Vec::<i64>::new()));
    let turned = Arc::new(Mutex::new(0usize));
    let mut threads = Vec::new();
    // Enqueuers: COPY batches (100 rows) and multi-row INSERTs (40 rows).
    for (t, size) in [(0usize, 100usize), (1, 40), (2, 200)] {
        let (url, enqueued) = (db.url().to_string(), enqueued.clone());
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            for chunk in 0..12 {
                let batch: Vec<NewJob> = (0..size)
                    .map(|i| {
                        NewJob::new("atk", "a", vec![t as u8]).priority(((chunk + i) % 3) as i32)
                    })
                    .collect();
                let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
                assert_eq!(ids.len(), size);
                enqueued.lock().unwrap().extend(ids.iter().map(|e| e.id));
                std::thread::sleep(Duration::from_millis(60));
            }
        }));
    }
    // Callers' transactions that enqueue, then stay open across rotations, then commit.
    for mode in 0..3 {
        let (url, enqueued) = (db.url().to_string(), enqueued.clone());
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            for _ in 0..4 {
                let ids: Vec<i64> = match mode {
                    0 => tenure::transaction(&mut conn, |c| {
                        let batch: Vec<NewJob> =
                            (0..80).map(|_| NewJob::new("atk", "a", vec![9])).collect();
                        let ids = jobs::enqueue_many(c, &batch)?;
                        std::thread::sleep(Duration::from_millis(700));
                        let one = jobs::enqueue(c, &NewJob::new("atk", "a", vec![]))?;
                        Ok::<_, tenure::Error>(ids.iter().map(|e| e.id).chain([one.id]).collect())
                    })
                    .unwrap(),
                    _ => tenure::transaction(&mut conn, |c| {
                        if mode == 2 {
                            // The caller's own transaction, REPEATABLE READ.
                            c.batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")?;
                        }
                        // The snapshot is taken before the slots turn.
                        let _ = count(c, "SELECT COUNT(*) AS n FROM tenure_schedules");
                        std::thread::sleep(Duration::from_millis(400));
                        let batch: Vec<NewJob> =
                            (0..70).map(|_| NewJob::new("atk", "a", vec![8])).collect();
                        let ids = jobs::enqueue_many(c, &batch)?;
                        std::thread::sleep(Duration::from_millis(700));
                        Ok::<_, tenure::Error>(ids.iter().map(|e| e.id).collect())
                    })
                    .unwrap(),
                };
                enqueued.lock().unwrap().extend(ids);
            }
        }));
    }
    let completed = Arc::new(Mutex::new(Vec::<i64>::new()));
    for _ in 0..2 {
        let (url, done, completed) = (db.url().to_string(), done.clone(), completed.clone());
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            while !done.load(Ordering::SeqCst) {
                let batch = jobs::claim(&mut conn, "atk", 50, TTL).unwrap();
                if batch.is_empty() {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
                let finished = jobs::complete(&mut conn, &claims).unwrap();
                assert_eq!(finished.len(), claims.len());
                completed.lock().unwrap().extend(batch.iter().map(|j| j.id));
            }
        }));
    }
    {
        let (url, done, turned) = (db.url().to_string(), done.clone(), turned.clone());
        threads.push(std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).unwrap();
            while !done.load(Ordering::SeqCst) {
                jobs::prune(
                    &mut conn,
                    "atk",
                    Finished::Completed,
                    Retention::DeleteAll,
                    1000,
                )
                .unwrap();
                if rotate(&mut conn).is_some() {
                    *turned.lock().unwrap() += 1;
                }
            }
        }));
    }
    let expected = 12 * (100 + 40 + 200) + 4 * 81 + 2 * 4 * 70;
    let deadline = Instant::now() + Duration::from_secs(120);
    while completed.lock().unwrap().len() < expected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let stragglers (duplicates) show up.
    std::thread::sleep(Duration::from_millis(300));
    done.store(true, Ordering::SeqCst);
    for thread in threads {
        thread.join().unwrap();
    }
    let completed = completed.lock().unwrap().clone();
    let unique: HashSet<i64> = completed.iter().copied().collect();
    assert_eq!(unique.len(), completed.len(), "a job ran twice");
    let enqueued: HashSet<i64> = enqueued.lock().unwrap().iter().copied().collect();
    assert_eq!(enqueued.len(), expected);
    let lost: Vec<_> = enqueued.difference(&unique).take(10).collect();
    assert!(
        lost.is_empty(),
        "{} lost, e.g. {lost:?}",
        enqueued.len() - unique.len()
    );
    assert!(
        *turned.lock().unwrap() >= 3,
        "turned {}",
        turned.lock().unwrap()
    );
}

/// Every keyed path (single, multi-row upsert, enqueue_many mixing keyed and plain, a batch
/// of >= 64 with one key, a dedup window's fold, a workflow with a keyed job, a schedule
/// with a key, typed jobs, retry_dead of a keyed job, cancel) works with the slots turning
/// between steps, and keys stay unique among live jobs.
#[test]
fn postgres_every_keyed_path_keeps_keys_unique_across_rotations() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let turn = |conn: &mut AnyConnection| {
        jobs::prune(conn, "k", Finished::Completed, Retention::DeleteAll, 1000).unwrap();
        for _ in 0..7 {
            rotate(conn);
        }
    };
    // Single and twin.
    let a = jobs::enqueue(&mut conn, &NewJob::new("k", "a", vec![]).dedup_key("a")).unwrap();
    turn(&mut conn);
    let a2 = jobs::enqueue(&mut conn, &NewJob::new("k", "a", vec![]).dedup_key("a")).unwrap();
    assert!(a2.existing && a2.id == a.id);
    // Multi-row upsert of keyed jobs, and a mix of keyed and plain.
    let mixed: Vec<NewJob> = (0..10)
        .map(|i| {
            let job = NewJob::new("k", "a", vec![]);
            if i % 3 == 0 {
                job
            } else {
                job.dedup_key(format!("m{}", i % 5))
            }
        })
        .collect();
    let made = jobs::enqueue_many(&mut conn, &mixed).unwrap();
    turn(&mut conn);
    let again = jobs::enqueue_many(&mut conn, &mixed).unwrap();
    for (i, (m, g)) in made.iter().zip(&again).enumerate() {
        if i % 3 != 0 {
            assert!(
                g.existing && g.id == m.id,
                "keyed job {i} folds: {m:?} {g:?}"
            );
        }
    }
    // A long batch with one keyed job (not COPY) and one all plain (COPY).
    let mut long: Vec<NewJob> = (0..100).map(|_| NewJob::new("k", "a", vec![])).collect();
    long[50] = NewJob::new("k", "a", vec![]).dedup_key("long");
    assert_eq!(jobs::enqueue_many(&mut conn, &long).unwrap().len(), 100);
    turn(&mut conn);
    // A dedup window: done, pruned never (window keeps it), a twin folds into the finished job.
    let w = jobs::enqueue(
        &mut conn,
        &NewJob::new("w", "a", vec![])
            .dedup_key("win")
            .dedup_window(Duration::from_secs(600), jobs::DedupOver::Completed),
    )
    .unwrap();
    turn(&mut conn);
    // A workflow (keyed steps are refused before any statement) with a dependent.
    let mut flow = jobs::Workflow::new("f");
    let first = flow.add(NewJob::new("k", "a", vec![]));
    flow.add_after(&[first], NewJob::new("k", "a", vec![]));
    let flowed = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    turn(&mut conn);
    // A schedule with a key, fired.
    tenure::schedules::upsert(
        &mut conn,
        &tenure::schedules::Schedule::every(
            "sched",
            Duration::from_millis(10),
            NewJob::new("k", "a", vec![]).dedup_key("sched"),
        ),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    tenure::schedules::tick(&mut conn).unwrap();
    turn(&mut conn);
    std::thread::sleep(Duration::from_millis(30));
    tenure::schedules::tick(&mut conn).unwrap();
    // retry_dead of a keyed job: claimed, failed for good, retried.
    let d = jobs::enqueue(&mut conn, &NewJob::new("d", "a", vec![]).dedup_key("dead")).unwrap();
    let c = jobs::claim(&mut conn, "d", 1, TTL).unwrap();
    assert_eq!(c[0].id, d.id);
    jobs::fail(&mut conn, c[0].claim(), "boom", Retry::Never).unwrap();
    turn(&mut conn);
    // A new live job with the key while the old one is dead: retry_dead must not make two.
    let d2 = jobs::enqueue(&mut conn, &NewJob::new("d", "a", vec![]).dedup_key("dead")).unwrap();
    assert!(!d2.existing);
    let retried = jobs::retry_dead(&mut conn, d.id);
    turn(&mut conn);
    let live = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'd' AND dedup_key = 'dead' \
         AND state IN ('waiting', 'running')",
    );
    assert!(
        live <= 1,
        "two live jobs with one key (retry_dead gave {retried:?})"
    );
    // The windowed job: finish it, rotate, and a twin folds in.
    let wc = jobs::claim(&mut conn, "w", 1, TTL).unwrap();
    jobs::complete(&mut conn, &[wc[0].claim()]).unwrap();
    turn(&mut conn);
    let w2 = jobs::enqueue(
        &mut conn,
        &NewJob::new("w", "a", vec![])
            .dedup_key("win")
            .dedup_window(Duration::from_secs(600), jobs::DedupOver::Completed),
    )
    .unwrap();
    assert!(w2.existing && w2.id == w.id, "{w2:?} vs {w:?}");
    // Cancel a keyed job.
    assert!(jobs::cancel(&mut conn, a.id).unwrap());
    turn(&mut conn);
    // No keyed job anywhere but kept; every live key unique.
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE dedup_key IS NOT NULL AND slot <> -1"
        ),
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM (SELECT queue, dedup_key FROM tenure_jobs \
             WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'running') \
             GROUP BY 1, 2 HAVING COUNT(*) > 1) t"
        ),
        0
    );
    let _ = flowed;
    // Everything left drains once.
    let k = drain(&mut conn, "k");
    let unique: HashSet<_> = k.iter().collect();
    assert_eq!(unique.len(), k.len());
}

/// A rotation whose session is killed after it moved the sequence (setval is not
/// transactional) and truncated (rolled back): nothing is lost, enqueues and claims go on,
/// and later rotations still turn.
#[test]
fn postgres_a_rotation_killed_after_its_setval_loses_nothing() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let mut victim = db.connect_raw();
    let mut ids: Vec<i64> = jobs::enqueue_many(
        &mut conn,
        &(0..100)
            .map(|_| NewJob::new("kill", "a", vec![]))
            .collect::<Vec<_>>(),
    )
    .unwrap()
    .iter()
    .map(|e| e.id)
    .collect();
    let pid = count(&mut victim, "SELECT pg_backend_pid()::bigint AS n");
    victim
        .batch_execute("BEGIN; SELECT tenure_rotate_job_slots(0, 1000)")
        .unwrap();
    let slot = count(
        &mut conn,
        "SELECT pg_sequence_last_value('tenure_jobs_slot')::bigint AS n",
    );
    assert_eq!(slot, 1, "the sequence moved before the commit");
    // An enqueue now waits for the victim's lock on slot 1; the victim is killed meanwhile.
    let url = db.url().to_string();
    let waiter = std::thread::spawn(move || {
        let mut c = AnyConnection::connect(&url).unwrap();
        jobs::enqueue_many(
            &mut c,
            &(0..100)
                .map(|_| NewJob::new("kill", "a", vec![]))
                .collect::<Vec<_>>(),
        )
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect::<Vec<i64>>()
    });
    std::thread::sleep(Duration::from_millis(300));
    count(
        &mut conn,
        &format!("SELECT pg_terminate_backend({pid})::int::bigint AS n"),
    );
    ids.extend(waiter.join().unwrap());
    for _ in 0..14 {
        rotate(&mut conn);
        ids.push(
            jobs::enqueue(&mut conn, &NewJob::new("kill", "a", vec![]))
                .unwrap()
                .id,
        );
    }
    let drained = drain(&mut conn, "kill");
    let got: HashSet<_> = drained.iter().copied().collect();
    assert_eq!(got.len(), drained.len());
    assert_eq!(got, ids.iter().copied().collect::<HashSet<_>>());
    while jobs::prune(
        &mut conn,
        "kill",
        Finished::Completed,
        Retention::DeleteAll,
        1000,
    )
    .unwrap()
        > 0
    {}
    let mut turned = 0;
    for _ in 0..6 {
        turned += rotate(&mut conn).is_some() as usize;
    }
    assert_eq!(turned, 6, "every slot turns again");
}

/// Retention that keeps jobs (KeepNewest, KeepYoungerThan) across rotations: nothing kept
/// is lost, and the slots turn again once it lets them go.
#[test]
fn postgres_jobs_retention_keeps_outlive_rotations() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    for round in 0..8 {
        jobs::enqueue_many(
            &mut conn,
            &(0..30)
                .map(|_| NewJob::new("r", "a", vec![]))
                .collect::<Vec<_>>(),
        )
        .unwrap();
        drain(&mut conn, "r");
        jobs::prune(
            &mut conn,
            "r",
            Finished::Completed,
            Retention::KeepNewest(45),
            1000,
        )
        .unwrap();
        jobs::prune(
            &mut conn,
            "r",
            Finished::Completed,
            Retention::KeepYoungerThan(Duration::from_secs(3600)),
            1000,
        )
        .unwrap();
        let before = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'r'",
        );
        for _ in 0..7 {
            rotate(&mut conn);
        }
        let kept = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'r'",
        );
        assert_eq!(kept, before, "round {round}: rotations dropped kept jobs");
        assert!(
            kept >= std::cmp::min(45, 30 * (round + 1)) as i64,
            "round {round}"
        );
    }
}

/// An application user granted row privileges on tenure's tables BEFORE the slots'
/// migration (as docs/guide.md says, run after an earlier `tenure migrate`): the migration
/// says "whoever had privileges on the old table has them on the new one". Keyed jobs are
/// inserted into `tenure_jobs_kept` named directly, a new table the user was never granted.
#[test]
fn postgres_an_app_user_granted_before_the_migration_enqueues_keyed_jobs() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    conn.batch_execute(include_str!(
        "../../../migrations/postgres/tenure-0056_job_slots/down.sql"
    ))
    .unwrap();
    diesel::sql_query("DELETE FROM __diesel_schema_migrations WHERE version LIKE '%0056%'")
        .execute(&mut conn)
        .unwrap();
    let role = format!("tenure_a_{}", uuid::Uuid::new_v4().simple());
    let mut admin = AnyConnection::connect(&server_url(Backend::Postgres)).unwrap();
    admin
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .unwrap();
    conn.batch_execute(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
    ))
    .unwrap();
    let applied = tenure::run_migrations(&mut conn).unwrap();
    assert_eq!(applied.len(), 1);
    let mut url = url::Url::parse(db.url()).unwrap();
    url.set_username(&role).unwrap();
    let mut app = AnyConnection::connect(url.as_str()).unwrap();
    let plain = jobs::enqueue(&mut app, &NewJob::new("p", "a", vec![]));
    let keyed = jobs::enqueue(&mut app, &NewJob::new("p", "a", vec![]).dedup_key("k"));
    drop(app);
    drop(conn);
    drop(db);
    let _ = admin.batch_execute(&format!("DROP ROLE {role}"));
    plain.expect("a plain enqueue by the app user");
    keyed.expect("a keyed enqueue by the app user who had privileges before the migration");
}

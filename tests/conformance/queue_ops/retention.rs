//! Retention: a prune keeps the newest job even while it commits (the reference report's
//! two-step prune loses it), keep-newest and keep-young policies on 10,000 jobs, and a
//! worker's pass of batches, each starting where the last ended.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, Finished, JobState, NewJob, Outcome, Retention};
use tenure::{AnyConnection, Backend, Error, TenureConnection};

use super::TTL;
use crate::common::{TestDb, conformance, count, now_sql, placeholders};

conformance!(
    two_step_prune_loses_the_newest_and_tenure_prune_keeps_it,
    keep_newest_and_keep_young_on_ten_thousand_jobs,
    a_workers_prune_pass_takes_every_job_whose_finish_instant_a_batch_split,
    a_pass_fed_by_a_steady_finisher_never_returns_for_jobs_behind_its_position,
);

fn completed_ids(conn: &mut AnyConnection, queue: &str) -> Vec<i64> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    let sql = format!(
        "SELECT id FROM tenure_jobs WHERE queue = {} AND state = 'completed' ORDER BY id",
        placeholders(conn.backend(), 1)
    );
    diesel::sql_query(sql)
        .bind::<diesel::sql_types::Text, _>(queue)
        .load::<Id>(conn)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// Job A completed, job B claimed (it will finish later, so it is the newer).
fn older_done_newer_running(conn: &mut AnyConnection, queue: &str) -> (i64, jobs::ClaimedJob) {
    let pair = [
        NewJob::new(queue, "k", vec![]),
        NewJob::new(queue, "k", vec![]),
    ];
    jobs::enqueue_many(conn, &pair).unwrap();
    let mut claimed = jobs::claim(conn, queue, 2, TTL).unwrap();
    let newer = claimed.pop().unwrap();
    let older = claimed.pop().unwrap();
    assert_eq!(
        jobs::complete(conn, &[older.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    std::thread::sleep(Duration::from_millis(20));
    (older.id, newer)
}

/// The reference report's retention bug, deterministically, keeping the newest 1.
fn two_step_prune_loses_the_newest_and_tenure_prune_keeps_it(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();

    // Negative control: read the ids to keep; the newer job finishes between the steps; then
    // delete the others.
    let (_, newer) = older_done_newer_running(&mut conn, "naive");
    let keep = completed_ids(&mut conn, "naive");
    assert_eq!(
        jobs::complete(&mut conn, &[newer.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    let keep_list = keep
        .iter()
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    conn.batch_execute(&format!(
        "DELETE FROM tenure_jobs WHERE queue = 'naive' AND state = 'completed' AND id NOT IN ({keep_list})"
    ))
    .unwrap();
    assert!(
        jobs::get(&mut conn, newer.id).unwrap().is_none(),
        "the two-step prune deleted the newest job"
    );

    // tenure: the newer job's completion is committed while the prune runs.
    let (older, newer) = older_done_newer_running(&mut conn, "tenure");
    let held = Arc::new(Barrier::new(2));
    let go = Arc::new(Barrier::new(2));
    let finisher = {
        let mut c = db.connect();
        let (held, go, claim) = (held.clone(), go.clone(), newer.claim());
        std::thread::spawn(move || {
            tenure::transaction(&mut c, |c| {
                assert_eq!(jobs::complete(c, &[claim])?, vec![Outcome::Done]);
                held.wait();
                go.wait();
                // Hold the commit a little longer (the prune may be waiting for it).
                std::thread::sleep(Duration::from_millis(200));
                Ok::<_, Error>(())
            })
            .unwrap();
        })
    };
    held.wait();
    let pruner = {
        let mut c = db.connect();
        std::thread::spawn(move || {
            jobs::prune(
                &mut c,
                "tenure",
                Finished::Completed,
                Retention::KeepNewest(1),
                100,
            )
        })
    };
    go.wait();
    finisher.join().unwrap();
    let first = pruner.join().unwrap().unwrap();
    assert_eq!(
        jobs::get(&mut conn, newer.id).unwrap().unwrap().state,
        JobState::Completed,
        "tenure kept the newest"
    );
    // Once it is visible, it is the one kept.
    let second = jobs::prune(
        &mut conn,
        "tenure",
        Finished::Completed,
        Retention::KeepNewest(1),
        100,
    )
    .unwrap();
    assert_eq!(first + second, 1);
    assert_eq!(completed_ids(&mut conn, "tenure"), vec![newer.id]);
    assert!(jobs::get(&mut conn, older).unwrap().is_none());
    println!(
        "{backend} retention race: two-step prune lost the newest job; tenure prune kept it \
         (deleted {first} while the newer commit was held, {second} after)"
    );
}

/// Inserts `n` completed jobs on `queue` in one statement: job k (0 to n-1, kept in its
/// `priority` so a test can name the jobs a prune kept) finished k hours before the
/// statement's clock. An hour apart, so the clock moving on while a test runs (seconds, on a
/// slow machine) never moves a job across a retention boundary.
pub(crate) fn finished_jobs(conn: &mut AnyConnection, queue: &str, n: usize) {
    let backend = conn.backend();
    let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
        UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
        UNION ALL SELECT 8 UNION ALL SELECT 9)";
    assert_eq!(n, 10_000);
    let k = "(a.d * 1000 + b.d * 100 + c.d * 10 + e.d)";
    let ago = match backend {
        Backend::Postgres => format!("statement_timestamp() - {k} * interval '1 hour'"),
        Backend::Mysql => format!("UTC_TIMESTAMP(6) - INTERVAL {k} HOUR"),
        Backend::Sqlite => {
            format!("strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || {k} || ' hours')")
        }
    };
    let payload = if backend == Backend::Postgres {
        "'\\x00'::bytea"
    } else {
        "x'00'"
    };
    conn.batch_execute(&format!(
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at, finished_at) \
         SELECT '{queue}', 'k', {payload}, {k}, 'completed', 1, 1, {now}, {now}, {ago} \
         FROM {digits} a, {digits} b, {digits} c, {digits} e",
        now = now_sql(backend)
    ))
    .unwrap();
}

/// Retention by count and by age on 10,000 jobs per queue, finished an hour apart. The
/// expectations name the jobs kept (by their number), never an instant: the policies' own
/// reads of the clock happen more than a second after the jobs were made (a pause shows
/// it), which the test's first version, with jobs a second apart and its own second reading
/// of the clock, did not survive on a busy machine (item 13).
fn keep_newest_and_keep_young_on_ten_thousand_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let total = |conn: &mut AnyConnection, q: &str| {
        count(
            conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{q}'"),
        )
    };
    // The numbers of the jobs left: (how many, the oldest one's number).
    let kept = |conn: &mut AnyConnection, q: &str| {
        let sql = format!(
            "SELECT CAST(COALESCE(MAX(priority), -1) AS {}) AS n FROM tenure_jobs WHERE queue = '{q}'",
            if backend == Backend::Mysql {
                "SIGNED"
            } else {
                "BIGINT"
            }
        );
        (total(conn, q), count(conn, &sql))
    };
    let drain = |conn: &mut AnyConnection, q: &str, policy: Retention| {
        let mut deleted = 0;
        loop {
            let n = jobs::prune(conn, q, Finished::Completed, policy, 1000).unwrap();
            deleted += n;
            if n < 1000 {
                return deleted;
            }
        }
    };
    for queue in ["newest", "young", "both", "all"] {
        finished_jobs(&mut conn, queue, 10_000);
    }
    // Longer than the margins of the first version of this test.
    std::thread::sleep(Duration::from_millis(1500));
    let hours = |h: u64| Duration::from_secs(h * 3600);

    assert_eq!(
        drain(&mut conn, "newest", Retention::KeepNewest(2500)),
        7500
    );
    assert_eq!(
        kept(&mut conn, "newest"),
        (2500, 2499),
        "jobs 0 to 2499 kept"
    );

    let younger_than = hours(3000) + Duration::from_secs(1800);
    assert_eq!(
        drain(&mut conn, "young", Retention::KeepYoungerThan(younger_than)),
        6999
    );
    assert_eq!(
        kept(&mut conn, "young"),
        (3001, 3000),
        "jobs 0 to 3000 kept"
    );

    let policy = Retention::KeepNewestOrYounger {
        newest: 5000,
        younger_than: hours(1000) + Duration::from_secs(1800),
    };
    assert_eq!(drain(&mut conn, "both", policy), 5000);
    assert_eq!(kept(&mut conn, "both"), (5000, 4999), "jobs 0 to 4999 kept");
    let policy = Retention::KeepNewestOrYounger {
        newest: 10,
        younger_than: hours(1000) + Duration::from_secs(1800),
    };
    assert_eq!(drain(&mut conn, "both", policy), 3999);
    assert_eq!(kept(&mut conn, "both"), (1001, 1000), "jobs 0 to 1000 kept");

    assert_eq!(drain(&mut conn, "all", Retention::KeepAll), 0);
    assert_eq!(drain(&mut conn, "all", Retention::DeleteAll), 10_000);
    assert_eq!(total(&mut conn, "all"), 0);
    // Only finished jobs of the outcome asked for go: a live job stays.
    jobs::enqueue(&mut conn, &NewJob::new("all", "k", vec![])).unwrap();
    assert_eq!(drain(&mut conn, "all", Retention::DeleteAll), 0);
    assert_eq!(
        jobs::prune(&mut conn, "all", Finished::Dead, Retention::DeleteAll, 10).unwrap(),
        0
    );
    assert_eq!(total(&mut conn, "all"), 1);
}

/// A worker's prune pass reads each batch from where the last one ended (its
/// `(finished_at, id)`), not from the first finished job again. Jobs completed in one call
/// share one finish instant: here 2,500 in calls of 700, so the pass's first batch of 1,000
/// ends inside the second call's instant. The pass must still take every job it passes (its
/// `Pruned` event 2,500, or whole batches where its budget stopped it early): a position
/// compared by finish time alone skipped that instant's other 400 jobs (a pass of 2,100 with
/// 400 left), one by id alone every job finished before it with a larger id.
fn a_workers_prune_pass_takes_every_job_whose_finish_instant_a_batch_split(backend: Backend) {
    use std::sync::Mutex;
    use std::sync::mpsc::channel;
    use tenure::events::Event;
    use tenure::worker::Worker;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let total = 2_500;
    let batch: Vec<NewJob> = (0..total)
        .map(|_| NewJob::new("pruned", "k", vec![]))
        .collect();
    for chunk in batch.chunks(1_000) {
        jobs::enqueue_many(&mut conn, chunk).unwrap();
    }
    let mut done = 0;
    while done < total {
        let claimed = jobs::claim(&mut conn, "pruned", 700, TTL).unwrap();
        assert!(
            !claimed.is_empty(),
            "{done} of {total} completed, none left to claim"
        );
        let claims: Vec<_> = claimed.iter().map(|job| job.claim()).collect();
        assert!(
            jobs::complete(&mut conn, &claims)
                .unwrap()
                .iter()
                .all(|o| *o == Outcome::Done)
        );
        done += claimed.len();
        // The next call's instant is a later one.
        std::thread::sleep(Duration::from_millis(5));
    }
    let (passes, pruned) = channel::<usize>();
    let passes = Mutex::new(passes);
    let worker = Worker::builder(db.pool(4))
        .queue("elsewhere")
        .threads(1)
        .retention("pruned", Finished::Completed, Retention::DeleteAll)
        .on_event(move |event: &Event| {
            if let Event::Pruned { queue, deleted } = event {
                if queue == "pruned" {
                    let _ = passes.lock().unwrap().send(*deleted);
                }
            }
        })
        .raw_handler("k", |_, _: &[u8]| Ok(()))
        .start()
        .unwrap();
    // A pass may stop on its budget (ten calls, 500 ms: a busy machine), after a full batch;
    // it ends early otherwise only where a batch found fewer jobs than it asked for, which,
    // with jobs left, is a position that skipped them.
    let mut passes = Vec::new();
    while passes.iter().sum::<usize>() < total {
        passes.push(
            pruned
                .recv_timeout(Duration::from_secs(60))
                .expect("a prune pass within a minute"),
        );
    }
    worker.shutdown(Duration::from_secs(10));
    let (last, before_last) = passes.split_last().unwrap();
    assert!(
        before_last.iter().all(|n| n % jobs::MAX_BATCH == 0) && *last <= total,
        "passes deleted {passes:?} of {total}: one ended on a short batch with jobs left"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'pruned'"
        ),
        0
    );
}

/// A pass goes on while each batch deletes a full MAX_BATCH (ten at most), each from the
/// last one's position. A steady finisher (here 1,000 completed jobs a statement whenever
/// fewer than 4,000 are left) keeps every batch full, so passes follow one another without
/// end: retention must still come back
/// for jobs behind its position, a job whose dedup window closes after the pass passed it
/// and a job that commits with an older finish time (a finisher's transaction committing
/// late). With a position never reset, both stayed as long as the load lasted (a helper's
/// attack: PostgreSQL and MariaDB; SQLite's one writer ends each pass).
fn a_pass_fed_by_a_steady_finisher_never_returns_for_jobs_behind_its_position(backend: Backend) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tenure::jobs::DedupOver;
    use tenure::worker::Worker;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // The dedup job: completed, its 1 s window open when the pass starts.
    let dedup = NewJob::new("fed", "k", vec![])
        .dedup_key("d")
        .dedup_window(Duration::from_secs(1), DedupOver::Completed);
    jobs::enqueue(&mut conn, &dedup).unwrap();
    let claimed = jobs::claim(&mut conn, "fed", 1, TTL).unwrap();
    let dedup_id = claimed[0].id;
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    let payload = fed_payload(backend);
    let now = now_sql(backend);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let producer = s.spawn(|| keep_fed(&db, &stop));
        std::thread::sleep(Duration::from_millis(300));
        let worker = Worker::builder(db.pool(4))
            .queue("elsewhere")
            .threads(1)
            .retention("fed", Finished::Completed, Retention::DeleteAll)
            .raw_handler("k", |_, _: &[u8]| Ok(()))
            .start()
            .unwrap();
        std::thread::sleep(Duration::from_secs(2));
        // A job finished an hour ago commits now, behind the pass's position.
        let late_sql = match backend {
            Backend::Postgres => "statement_timestamp() - interval '1 hour'",
            Backend::Mysql => "UTC_TIMESTAMP(6) - INTERVAL 1 HOUR",
            Backend::Sqlite => "strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hours')",
        };
        conn.batch_execute(&format!(
            "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at, finished_at) \
             VALUES ('fed', 'late', {payload}, 0, 'completed', 1, 1, {now}, {now}, {late_sql})"
        ))
        .unwrap();
        // Both go within the pass, or by the next one; the finisher keeps every batch full.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let (mut dedup_left, mut late_left);
        loop {
            dedup_left = count(
                &mut conn,
                &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {dedup_id}"),
            );
            late_left = count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'fed' AND kind = 'late'",
            );
            if (dedup_left, late_left) == (0, 0) || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, Ordering::Relaxed);
        let inserted = producer.join().unwrap();
        worker.shutdown(Duration::from_secs(10));
        assert!(
            inserted >= 5_000,
            "the finisher kept up only {inserted} jobs"
        );
        assert_eq!(
            (dedup_left, late_left),
            (0, 0),
            "30 s into a worker's retention under a steady finisher ({inserted} jobs): \
             dedup job past its window left {dedup_left}, late-committed old job left {late_left}"
        );
    });
}

pub(crate) fn fed_payload(backend: Backend) -> &'static str {
    if backend == Backend::Postgres {
        "'\\x00'::bytea"
    } else {
        "x'00'"
    }
}

/// A steady finisher: 1,000 completed jobs of queue `fed` a statement whenever fewer than
/// 4,000 are left, until `stop`. Returns how many it inserted.
pub(crate) fn keep_fed(db: &TestDb, stop: &std::sync::atomic::AtomicBool) -> u64 {
    use std::sync::atomic::Ordering;
    let backend = db.backend;
    let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
        UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
        UNION ALL SELECT 8 UNION ALL SELECT 9)";
    let (payload, now) = (fed_payload(backend), now_sql(backend));
    let insert = format!(
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at, finished_at) \
         SELECT 'fed', 'k', {payload}, 0, 'completed', 1, 1, {now}, {now}, {now} \
         FROM {digits} a, {digits} b, {digits} c"
    );
    let mut c = db.connect();
    let mut inserted = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let n = count(
            &mut c,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'fed'",
        );
        if n < 4_000 {
            if c.batch_execute(&insert).is_ok() {
                inserted += 1_000;
            }
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    inserted
}

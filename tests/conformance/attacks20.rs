//! Attacks on NOTIFY after commit, bulk enqueue by COPY on PostgreSQL, and
//! `jobs::queue_depth`.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use diesel::connection::SimpleConnection;

use tenure::jobs::{self, Job, NewJob, QueueDepth};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count, race};

conformance!(
    attacks20_edge_fields_are_the_same_by_copy_and_by_insert,
    attacks20_batches_of_63_64_and_65_agree,
    attacks20_concurrent_bulk_enqueues_and_claims_never_mix_ids,
    attacks20_a_callers_failed_transaction_refuses_a_long_batch_cleanly,
    attacks20_depth_agrees_with_the_table,
    attacks20_a_workflow_of_100_independent_steps_is_whole,
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

fn attacks20_edge_fields_are_the_same_by_copy_and_by_insert(backend: Backend) {
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

fn attacks20_batches_of_63_64_and_65_agree(backend: Backend) {
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
fn attacks20_concurrent_bulk_enqueues_and_claims_never_mix_ids(backend: Backend) {
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

fn attacks20_a_callers_failed_transaction_refuses_a_long_batch_cleanly(backend: Backend) {
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

fn attacks20_depth_agrees_with_the_table(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..120)
        .map(|i| {
            let job = NewJob::new(if i % 10 == 0 { "Q" } else { "q" }, "k", vec![]);
            match i % 3 {
                0 => job.delay(Duration::from_secs(3600)),
                1 => job.at(Utc::now() - TimeDelta::days(365 * 50)),
                _ => job,
            }
        })
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    jobs::claim(&mut conn, "q", 7, Duration::from_secs(60)).unwrap();
    let expect = |queue: &str, bound: u64| {
        let of = |pred: &dyn Fn(usize) -> bool| {
            (0..120)
                .filter(|i| (i % 10 == 0) == (queue == "Q") && pred(*i))
                .count() as u64
        };
        let waiting = of(&|_| true);
        let due = of(&|i| i % 3 != 0);
        let claimed = if queue == "q" { 7 } else { 0 };
        QueueDepth {
            waiting: (waiting - claimed).min(bound),
            due: (due - claimed).min(bound),
            running: claimed.min(bound),
        }
    };
    for queue in ["q", "Q"] {
        for bound in [1u32, 5, 70, 1000, jobs::MAX_DEPTH_BOUND] {
            assert_eq!(
                jobs::queue_depth(&mut conn, queue, bound).unwrap(),
                expect(queue, u64::from(bound)),
                "{queue} bound {bound}"
            );
        }
    }
    // Names that differ only in case, trailing space or a prefix are other queues.
    for other in ["q ", "qq", "Q ", " q"] {
        assert_eq!(
            jobs::queue_depth(&mut conn, other, 100).unwrap(),
            QueueDepth::default(),
            "{other:?}"
        );
    }
}

/// A workflow's first run of 100 steps without dependencies (copied on PostgreSQL): every
/// step is the workflow's, and its callback runs once they all completed.
fn attacks20_a_workflow_of_100_independent_steps_is_whole(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut flow = jobs::Workflow::new("wide");
    for i in 0..100u32 {
        flow.add(NewJob::new("w", "step", i.to_be_bytes().to_vec()).limit("wl", 100));
    }
    flow.on_success(NewJob::new("w", "done", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    assert_eq!(made.jobs.len(), 100);
    for (i, id) in made.jobs.iter().enumerate() {
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        assert_eq!(job.workflow_id, Some(made.id), "step {i}");
        assert_eq!(job.payload, (i as u32).to_be_bytes(), "step {i}");
    }
    let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
    assert_eq!((status.counts.waiting, status.counts.blocked), (100, 0));
    let claimed = jobs::claim(&mut conn, "w", 1000, Duration::from_secs(60)).unwrap();
    assert_eq!(claimed.len(), 100);
    let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
    jobs::complete(&mut conn, &claims).unwrap();
    let done = jobs::get(&mut conn, made.on_success.unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(done.state, jobs::JobState::Waiting);
}

// ---------------------------------------------------------------------------------------
// PostgreSQL only.

#[cfg(feature = "postgres")]
mod pg {
    use std::time::{Duration, Instant};

    use diesel::connection::SimpleConnection;

    use tenure::jobs::{self, NewJob};
    use tenure::{AnyConnection, Backend};

    use crate::common::{TestDb, count, server_url};
    use crate::wakeups::received;

    /// A role with exactly README.md's application privileges ("On a server"), and a URL to
    /// connect as it. Dropped with the returned guard.
    struct AppRole {
        name: String,
        url: String,
    }

    impl AppRole {
        fn new(db: &TestDb) -> AppRole {
            let name = format!("tenure_a20_{}", uuid::Uuid::new_v4().simple());
            let mut admin = AnyConnection::connect(&server_url(Backend::Postgres)).unwrap();
            admin
                .batch_execute(&format!("CREATE ROLE {name} LOGIN"))
                .unwrap();
            db.connect()
                .batch_execute(&format!(
                    "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {name}"
                ))
                .unwrap();
            let mut url = url::Url::parse(db.url()).unwrap();
            url.set_username(&name).unwrap();
            AppRole {
                name,
                url: url.to_string(),
            }
        }
    }

    impl Drop for AppRole {
        fn drop(&mut self) {
            if let Ok(mut admin) = AnyConnection::connect(&server_url(Backend::Postgres)) {
                // Its grants live in the test database, dropped after this guard (declared
                // before it): owned objects first.
                let _ = admin.batch_execute(&format!("DROP ROLE IF EXISTS {}", self.name));
            }
        }
    }

    fn plain(n: usize) -> Vec<NewJob> {
        (0..n)
            .map(|i| NewJob::new("app", "k", vec![i as u8]))
            .collect()
    }

    /// README.md's least privileges (row privileges on the tables, nothing on sequences)
    /// enqueue a batch of 63 by INSERT: a batch of 64 must go as well.
    #[test]
    fn attacks20_pg_app_user_enqueues_a_batch_of_64() {
        let db = TestDb::migrated(Backend::Postgres);
        let role = AppRole::new(&db);
        {
            let mut conn = AnyConnection::connect(&role.url).unwrap();
            assert_eq!(jobs::enqueue_many(&mut conn, &plain(63)).unwrap().len(), 63);
            let copied = jobs::enqueue_many(&mut conn, &plain(64));
            assert!(copied.is_ok(), "a batch of 64 as the app user: {copied:?}");
            // Inside the caller's transaction too.
            let inside =
                tenure::transaction(&mut conn, |conn| jobs::enqueue_many(conn, &plain(64)));
            assert!(inside.is_ok(), "{inside:?}");
            assert_eq!(
                count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
                191
            );
        }
        // Given the sequence too, the batch is copied.
        db.connect()
            .batch_execute(&format!(
                "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {}",
                role.name
            ))
            .unwrap();
        {
            let mut conn = AnyConnection::connect(&role.url).unwrap();
            let copied = jobs::enqueue_many(&mut conn, &plain(64));
            assert!(copied.is_ok(), "{copied:?}");
        }
        drop(db);
        drop(role);
    }

    /// A NOTIFY that fails after the commit (here: pg_notify not executable by the app user)
    /// is logged, never the enqueue's error: the jobs are in.
    #[test]
    fn attacks20_pg_notify_failing_after_the_commit_is_not_an_enqueue_error() {
        let db = TestDb::migrated(Backend::Postgres);
        let role = AppRole::new(&db);
        db.connect()
            .batch_execute(&format!(
                "REVOKE EXECUTE ON FUNCTION pg_notify(text, text) FROM PUBLIC; \
                 GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {}",
                role.name
            ))
            .unwrap();
        {
            let mut conn = AnyConnection::connect(&role.url).unwrap();
            let one = jobs::enqueue(&mut conn, &NewJob::new("app", "k", vec![]));
            assert!(one.is_ok(), "{one:?}");
            let limited = jobs::enqueue(&mut conn, &NewJob::new("app", "k", vec![]).limit("l", 1));
            assert!(limited.is_ok(), "{limited:?}");
            let few = jobs::enqueue_many(&mut conn, &plain(10));
            assert!(few.is_ok(), "{few:?}");
            let many = jobs::enqueue_many(&mut conn, &plain(100));
            assert!(many.is_ok(), "{many:?}");
            assert_eq!(
                count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
                112
            );
        }
        drop(db);
        drop(role);
    }

    /// A batch by COPY wakes each of its queues once after the commit; in a caller's
    /// transaction only if it commits.
    #[test]
    fn attacks20_pg_a_copied_batch_notifies_its_queues_after_commit_only() {
        let db = TestDb::migrated(Backend::Postgres);
        let mut listen = db.connect();
        listen.batch_execute("LISTEN tenure_jobs").unwrap();
        let mut conn = db.connect();
        let batch: Vec<NewJob> = (0..200)
            .map(|i| NewJob::new(["x", "y", "z"][i % 3], "k", vec![]))
            .collect();
        jobs::enqueue_many(&mut conn, &batch).unwrap();
        let mut got = received(&mut listen, Duration::from_millis(400));
        got.sort();
        assert_eq!(got, ["x", "y", "z"]);
        let rolled_back: Result<(), tenure::Error> = tenure::transaction(&mut conn, |conn| {
            jobs::enqueue_many(conn, &batch)?;
            Err(diesel::result::Error::RollbackTransaction.into())
        });
        assert!(rolled_back.is_err());
        assert_eq!(
            received(&mut listen, Duration::from_millis(400)),
            Vec::<String>::new()
        );
        tenure::transaction(&mut conn, |conn| jobs::enqueue_many(conn, &batch)).unwrap();
        let mut got = received(&mut listen, Duration::from_millis(400));
        got.sort();
        assert_eq!(got, ["x", "y", "z"]);
    }

    /// tenure's tables in a schema of their own on the search_path (README: "or a schema on
    /// PostgreSQL's search_path"), with a name that needs quoting, and a decoy `tenure_jobs`
    /// in public.
    #[test]
    fn attacks20_pg_copy_in_a_schema_on_the_search_path() {
        let db = TestDb::empty(Backend::Postgres);
        let name = url::Url::parse(db.url())
            .unwrap()
            .path()
            .trim_start_matches('/')
            .to_string();
        db.connect()
            .batch_execute(&format!(
                "CREATE SCHEMA \"Tenure App\"; \
                 ALTER DATABASE {name} SET search_path = \"Tenure App\", public; \
                 CREATE TABLE public.tenure_jobs (id bigint GENERATED BY DEFAULT AS IDENTITY)"
            ))
            .unwrap();
        let mut conn = db.connect();
        tenure::run_migrations(&mut conn).unwrap();
        let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &plain(100))
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect();
        for (i, id) in ids.iter().enumerate() {
            let job = jobs::get(&mut conn, *id).unwrap().expect("the job");
            assert_eq!(job.payload, [i as u8]);
        }
        assert_eq!(
            count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM \"Tenure App\".tenure_jobs"
            ),
            100
        );
        // Single enqueues after it take ids past the batch's.
        let after = jobs::enqueue(&mut conn, &NewJob::new("app", "k", vec![]))
            .unwrap()
            .id;
        assert!(after > *ids.last().unwrap());
    }

    /// A COPY that fails mid-stream (row 30 of 64 collides with a job given an explicit id):
    /// an error, nothing of the batch written, the connection and the caller's transaction
    /// usable.
    #[test]
    fn attacks20_pg_a_copy_failing_mid_stream_leaves_nothing_and_a_usable_connection() {
        let db = TestDb::migrated(Backend::Postgres);
        let mut conn = db.connect();
        let first = jobs::enqueue(&mut conn, &NewJob::new("app", "k", vec![]))
            .unwrap()
            .id;
        conn.batch_execute(&format!(
            "INSERT INTO tenure_jobs (id, queue, kind, payload, state, max_attempts, due_at, created_at) \
             VALUES ({}, 'app', 'k', '', 'waiting', 1, now(), now())",
            first + 30
        ))
        .unwrap();
        let r = jobs::enqueue_many(&mut conn, &plain(64));
        assert!(r.is_err(), "{r:?}");
        assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 2);
        // In a caller's transaction: its own work survives.
        tenure::transaction(&mut conn, |conn| {
            let kept = jobs::enqueue(conn, &NewJob::new("app", "kept", vec![]))?;
            conn.batch_execute(&format!(
                "INSERT INTO tenure_jobs (id, queue, kind, payload, state, max_attempts, due_at, created_at) \
                 VALUES ({}, 'app', 'k', '', 'waiting', 1, now(), now())",
                kept.id + 40
            ))?;
            let r = jobs::enqueue_many(conn, &plain(64));
            assert!(r.is_err(), "{r:?}");
            Ok::<_, tenure::Error>(())
        })
        .unwrap();
        assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 4);
        // Usable: the next batch goes.
        assert_eq!(
            jobs::enqueue_many(&mut conn, &plain(200)).unwrap().len(),
            200
        );
    }

    /// A user-set statement_timeout that a large batch exceeds (at whichever of its
    /// statements): an error, nothing written, the connection usable afterwards.
    #[test]
    fn attacks20_pg_statement_timeout_during_a_large_batch() {
        let db = TestDb::migrated(Backend::Postgres);
        let mut conn = db.connect();
        let batch: Vec<NewJob> = (0..100_000)
            .map(|i| NewJob::new("app", "k", vec![(i % 251) as u8; 200]))
            .collect();
        conn.batch_execute("SET statement_timeout = '150ms'")
            .unwrap();
        let r = jobs::enqueue_many(&mut conn, &batch);
        conn.batch_execute("SET statement_timeout = 0").unwrap();
        match r {
            Err(_) => assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0),
            Ok(ids) => assert_eq!(ids.len(), 100_000),
        }
        let ids = jobs::enqueue_many(&mut conn, &batch[..1000]).unwrap();
        assert_eq!(ids.len(), 1000);
        let job = jobs::get(&mut conn, ids[999].id).unwrap().unwrap();
        assert_eq!(job.payload, vec![(999 % 251) as u8; 200]);
    }

    /// A job another process committed and notified (raw SQL here: this process's own
    /// wake-up is not involved) starts at once on an idle worker with a long poll interval;
    /// and again after the worker's LISTEN connection was killed (it reconnects).
    #[test]
    fn attacks20_pg_listener_wakes_for_other_processes_jobs_and_after_its_connection_dies() {
        let db = TestDb::migrated(Backend::Postgres);
        let worker = tenure::worker::Worker::builder(db.pool(4))
            .queue("lq")
            .threads(1)
            .poll_interval(Duration::from_secs(60))
            .raw_handler("k", |_: &tenure::worker::JobContext, _: &[u8]| Ok(()))
            .start()
            .unwrap();
        let mut other = db.connect();
        let enqueue_elsewhere = |conn: &mut AnyConnection| {
            conn.batch_execute(
                "INSERT INTO tenure_jobs (queue, kind, payload, state, max_attempts, due_at, created_at) \
                 VALUES ('lq', 'k', '', 'waiting', 1, statement_timestamp(), statement_timestamp()); \
                 SELECT pg_notify('tenure_jobs', 'lq')",
            )
            .unwrap();
        };
        let completed_within = |n: usize, wait: Duration| {
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if worker.report().completed >= n {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            false
        };
        // Let the worker settle into its idle wait, LISTENing.
        std::thread::sleep(Duration::from_millis(500));
        enqueue_elsewhere(&mut other);
        assert!(completed_within(1, Duration::from_secs(3)), "not woken");
        let killed = count(
            &mut other,
            "SELECT COUNT(*) AS n FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND query = 'LISTEN tenure_jobs' \
             AND pid <> pg_backend_pid()) k",
        );
        assert_eq!(killed, 1, "the listener's session");
        std::thread::sleep(Duration::from_millis(1000));
        enqueue_elsewhere(&mut other);
        assert!(
            completed_within(2, Duration::from_secs(3)),
            "not woken after the listener's connection died: {:?}",
            worker.report()
        );
        worker.shutdown(Duration::from_secs(5));
    }

    /// 100,000 jobs in one batch, each with a concurrency limit and a rate.
    #[test]
    fn attacks20_pg_copy_of_100k_limited_jobs() {
        let db = TestDb::migrated(Backend::Postgres);
        let mut conn = db.connect();
        let batch: Vec<NewJob> = (0..100_000u32)
            .map(|i| {
                NewJob::new("app", "k", i.to_be_bytes().to_vec())
                    .limit(format!("c{}", i % 7), 3)
                    .rate_limit("r", 10, Duration::from_secs(1))
            })
            .collect();
        let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
        assert_eq!(ids.len(), 100_000);
        assert!(ids.windows(2).all(|w| w[0].id < w[1].id));
        for i in [0usize, 1, 63, 64, 99_998, 99_999] {
            let job = jobs::get(&mut conn, ids[i].id).unwrap().unwrap();
            assert_eq!(job.payload, (i as u32).to_be_bytes(), "job {i}");
            assert_eq!(jobs::limits_of(&mut conn, ids[i].id).unwrap().len(), 2);
        }
        assert_eq!(
            count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_limits"),
            200_000
        );
    }

    /// The largest payloads next to empty ones in one copied batch.
    #[test]
    fn attacks20_pg_copy_of_max_payloads() {
        let db = TestDb::migrated(Backend::Postgres);
        let mut conn = db.connect();
        let payload = |i: usize| {
            if i % 16 == 3 {
                vec![(i as u8).wrapping_mul(31); jobs::MAX_PAYLOAD_BYTES]
            } else {
                vec![]
            }
        };
        let batch: Vec<NewJob> = (0..64)
            .map(|i| NewJob::new("app", "k", payload(i)))
            .collect();
        let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
        for (i, e) in ids.iter().enumerate() {
            let job = jobs::get(&mut conn, e.id).unwrap().unwrap();
            assert_eq!(job.payload.len(), payload(i).len(), "job {i}");
            assert!(job.payload == payload(i), "job {i}");
        }
    }
}

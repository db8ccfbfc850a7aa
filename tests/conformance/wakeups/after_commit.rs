//! NOTIFY after the commit: a NOTIFY that fails after the commit is not an enqueue error, a
//! copied batch notifies its queues after the commit only, and a listener wakes for other
//! processes' jobs, also after its connection died.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, NewJob};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count, poll_until, server_url};
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

/// A NOTIFY that fails after the commit (here: pg_notify not executable by the app user)
/// is logged, never the enqueue's error: the jobs are in.
#[test]
fn pg_notify_failing_after_the_commit_is_not_an_enqueue_error() {
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
fn pg_a_copied_batch_notifies_its_queues_after_commit_only() {
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

/// A job another process committed and notified (raw SQL here: this process's own
/// wake-up is not involved) starts at once on an idle worker with a long poll interval;
/// and again after the worker's LISTEN connection was killed (it reconnects).
#[test]
fn pg_listener_wakes_for_other_processes_jobs_and_after_its_connection_dies() {
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
        poll_until(wait, Duration::from_millis(10), || {
            (worker.report().completed >= n).then_some(())
        })
        .is_some()
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

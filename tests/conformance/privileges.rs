//! The least privileges README.md's "On a server" gives the application user are enough:
//! after migrations ran as the owner, a user with only SELECT, INSERT, UPDATE and DELETE on
//! the tables enqueues, runs a worker (claims, limits, retries, snoozes, rescues, prunes),
//! fires schedules, takes and releases leases, and reads stats. (SQLite has no users: file
//! permissions only.)

use std::time::Duration;

use diesel::connection::SimpleConnection;

use serde::{Deserialize, Serialize};
use tenure::jobs::{self, Backoff, Finished, JobArgs, Retention};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::common::{TestDb, poll_until, server_url};

#[derive(Serialize, Deserialize)]
struct Task {
    n: u32,
}

impl JobArgs for Task {
    const KIND: &'static str = "task";
    const QUEUE: &'static str = "app";
    const BACKOFF: Option<Backoff> = Some(Backoff {
        base: Duration::from_millis(1),
        max: Duration::from_millis(1),
    });
    fn limit(&self) -> Option<(String, u32)> {
        Some((format!("key-{}", self.n % 3), 1))
    }
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_app_user_needs_only_row_privileges() {
    let db = TestDb::migrated(Backend::Postgres);
    let role = format!("tenure_w_{}", uuid::Uuid::new_v4().simple());
    let mut admin = AnyConnection::connect(&server_url(Backend::Postgres)).unwrap();
    admin
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .unwrap();
    db.connect()
        .batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
        ))
        .unwrap();
    let mut url = url::Url::parse(db.url()).unwrap();
    url.set_username(&role).unwrap();
    exercise(url.as_str());
    drop(db);
    admin.batch_execute(&format!("DROP ROLE {role}")).unwrap();
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_app_user_needs_only_row_privileges() {
    let db = TestDb::migrated(Backend::Mysql);
    let user = format!(
        "tenure_w_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    let mut url = url::Url::parse(db.url()).unwrap();
    let database = url.path().trim_start_matches('/').to_string();
    let mut admin = AnyConnection::connect(&server_url(Backend::Mysql)).unwrap();
    admin
        .batch_execute(&format!(
            "CREATE USER '{user}'@'%'; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON {database}.* TO '{user}'@'%'"
        ))
        .unwrap();
    url.set_username(&user).unwrap();
    exercise(url.as_str());
    // With the two privileges README gives for it, the same user rotates MariaDB's ring.
    admin
        .batch_execute(&format!(
            "GRANT LOCK TABLES ON {database}.* TO '{user}'@'%'; \
             GRANT DROP ON {database}.tenure_ready TO '{user}'@'%'"
        ))
        .unwrap();
    let mut conn = AnyConnection::connect(url.as_str()).unwrap();
    assert!(
        jobs::rotate_ready(&mut conn, Duration::ZERO)
            .unwrap()
            .is_some()
    );
    drop(conn);
    drop(db);
    admin
        .batch_execute(&format!("DROP USER '{user}'@'%'"))
        .unwrap();
}

/// Everything an application and its workers do, as the restricted user.
fn exercise(url: &str) {
    let mut conn = AnyConnection::connect(url).expect("the app user connects");
    // Really restricted: no DDL.
    assert!(
        conn.batch_execute("CREATE TABLE not_allowed (id INTEGER)")
            .is_err(),
        "the app user must not be able to create tables"
    );
    assert!(tenure::schema_version(&mut conn).unwrap().is_some());
    let tasks: Vec<Task> = (0..30).map(|n| Task { n }).collect();
    jobs::enqueue_jobs(&mut conn, &tasks).unwrap();
    // A batch long enough for PostgreSQL's COPY path, which takes ids from the sequence
    // (a privilege this user lacks: it inserts them as usual then).
    let bulk: Vec<jobs::NewJob> = (0..100)
        .map(|_| jobs::NewJob::new("bulk", "k", vec![]))
        .collect();
    assert_eq!(jobs::enqueue_many(&mut conn, &bulk).unwrap().len(), 100);
    // A workflow (its row's id comes from an identity column: no sequence privilege needed).
    let mut flow = jobs::Workflow::new("flow");
    let first = flow.add(jobs::NewJob::new("bulk", "k", vec![]));
    flow.add_after(&[first], jobs::NewJob::new("bulk", "k", vec![]));
    jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    // PostgreSQL's ready ring rotates (TRUNCATE, the generation's sequence: the owner's
    // function does them); MariaDB's needs a table lock and a partition's truncate, which
    // this user may not do: a clear error (the ring is reclaimed by purge alone), never
    // "nothing to do".
    let rotated = jobs::rotate_ready(&mut conn, Duration::ZERO);
    if url.starts_with("postgres") {
        assert!(rotated.unwrap().is_some());
    } else {
        let error = rotated.expect_err("a rotation without LOCK TABLES and DROP");
        assert!(error.to_string().contains("Access denied"), "{error}");
    }
    // A schedule the worker fires (its ticks are the tasks past the 30th).
    tenure::schedules::upsert(
        &mut conn,
        &tenure::schedules::Schedule::every(
            "tick",
            Duration::from_millis(200),
            Task { n: 99 }.to_job().unwrap(),
        ),
    )
    .unwrap();
    // A claim left to lapse, for the worker's rescue.
    jobs::claim(&mut conn, "app", 1, Duration::from_millis(1)).unwrap();
    std::thread::sleep(Duration::from_millis(20));

    let pool: Pool = Pool::options().max_size(8).open(url).unwrap();
    let worker = Worker::builder(pool.clone())
        .threads(2)
        .poll_interval(Duration::from_millis(20))
        .run_schedules()
        .retention("app", Finished::Completed, Retention::DeleteAll)
        .register(|ctx: &JobContext, task: Task| {
            match (task.n, ctx.attempt) {
                (1, 1) => Err("retry once")?,
                (2, 1) => return Err(JobError::snooze(Duration::ZERO)),
                _ => {}
            }
            Ok(())
        })
        .start()
        .unwrap();
    let mut report = worker.report();
    poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
        report = worker.report();
        (report.completed >= 31).then_some(())
    });
    let report_at_end = worker.shutdown(Duration::from_secs(5));
    assert!(report.completed >= 31, "{report:?}");
    assert!(
        report_at_end.retried >= 1 && report_at_end.snoozed >= 1,
        "{report_at_end:?}"
    );

    let mut lease = tenure::lease::try_take(&mut conn, "backup", Duration::from_secs(30), "host")
        .unwrap()
        .expect("free");
    lease.renew(&mut conn, Duration::from_secs(30)).unwrap();
    tenure::transaction(&mut conn, |c| lease.verify(c)).unwrap();
    assert!(lease.release(&mut conn).unwrap());
    let stats = jobs::stats(&mut conn).unwrap();
    assert!(stats.queues.iter().any(|q| q.queue == "app"));
}

//! PostgreSQL wakes other processes' idle workers by NOTIFY on the `tenure_jobs` channel, with
//! the queue as payload: after the commit of an enqueue tenure owns (in a transaction of its
//! own, so enqueuers' commits do not queue behind each other), inside a caller's
//! transaction otherwise (delivered only if it commits). MySQL/MariaDB and SQLite have no
//! such channel: other processes' workers poll (this process's are woken directly, on
//! every backend: see `worker::an_idle_worker_starts_an_enqueued_job_at_once`-style tests).

mod after_commit;

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::pg::PgConnection;
use tenure::jobs::{self, DedupOver, NewJob};
use tenure::{AnyConnection, Backend, TenureConnection};

use crate::common::{TestDb, count};

/// A second session LISTENing on tenure's channel.
pub(crate) fn listener(db: &TestDb) -> AnyConnection {
    let mut conn = db.connect();
    conn.batch_execute("LISTEN tenure_jobs").unwrap();
    conn
}

pub(crate) fn pg(conn: &mut AnyConnection) -> &mut PgConnection {
    match conn.backend_connection() {
        tenure::BackendConnection::Postgres(c) => c,
        #[allow(unreachable_patterns)]
        _ => unreachable!("a PostgreSQL connection"),
    }
}

/// The payloads delivered to `conn` within `wait` (polled; a notification that comes at all
/// comes within milliseconds).
pub(crate) fn received(conn: &mut AnyConnection, wait: Duration) -> Vec<String> {
    let deadline = Instant::now() + wait;
    let mut payloads = Vec::new();
    loop {
        // Reading a notification needs a round trip to the server.
        pg(conn).batch_execute("SELECT 1").unwrap();
        for n in pg(conn).notifications_iter() {
            payloads.push(n.unwrap().payload);
        }
        if Instant::now() >= deadline {
            return payloads;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_enqueue_outside_a_transaction_notifies_its_queue_once_committed() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut listen = listener(&db);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("mail", "send", vec![]))
        .unwrap()
        .id;
    assert_eq!(received(&mut listen, Duration::from_millis(500)), ["mail"]);
    // Committed before the wake-up: the listener's own session sees the job.
    let sql = format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id}");
    assert_eq!(count(&mut listen, &sql), 1, "job {id} visible");
}

#[test]
fn a_bulk_enqueue_notifies_each_queue_once() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut listen = listener(&db);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..50)
        .map(|i| NewJob::new(if i % 2 == 0 { "a" } else { "b" }, "k", vec![]))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let mut got = received(&mut listen, Duration::from_millis(500));
    got.sort();
    assert_eq!(got, ["a", "b"]);
}

#[test]
fn an_enqueue_in_a_callers_transaction_notifies_only_if_it_commits() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut listen = listener(&db);
    let mut conn = db.connect();
    let keyed = NewJob::new("windowed", "k", vec![])
        .dedup_key("x")
        .dedup_window(Duration::from_secs(60), DedupOver::Completed);
    let rolled_back: Result<(), tenure::Error> = tenure::transaction(&mut conn, |conn| {
        jobs::enqueue(conn, &NewJob::new("plain", "k", vec![]))?;
        jobs::enqueue(conn, &keyed)?;
        jobs::enqueue_many(conn, &[NewJob::new("many", "k", vec![])])?;
        Err(diesel::result::Error::RollbackTransaction.into())
    });
    assert!(rolled_back.is_err());
    assert_eq!(
        received(&mut listen, Duration::from_millis(500)),
        Vec::<String>::new(),
        "a rolled-back enqueue woke a worker"
    );
    tenure::transaction(&mut conn, |conn| {
        jobs::enqueue(conn, &NewJob::new("plain", "k", vec![]))?;
        jobs::enqueue(conn, &keyed)?;
        jobs::enqueue_many(conn, &[NewJob::new("many", "k", vec![])])?;
        Ok::<_, tenure::Error>(())
    })
    .unwrap();
    let mut got = received(&mut listen, Duration::from_millis(500));
    got.sort();
    assert_eq!(got, ["many", "plain", "windowed"]);
}

#[test]
fn enqueues_tenure_runs_in_a_transaction_of_its_own_notify_after_it() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut listen = listener(&db);
    let mut conn = db.connect();
    // A dedup window and a dependency each make the enqueue a transaction of tenure's own.
    let keyed = NewJob::new("windowed", "k", vec![])
        .dedup_key("x")
        .dedup_window(Duration::from_secs(60), DedupOver::Completed);
    jobs::enqueue(&mut conn, &keyed).unwrap();
    let first = jobs::enqueue(&mut conn, &NewJob::new("first", "k", vec![]))
        .unwrap()
        .id;
    let mut got = received(&mut listen, Duration::from_millis(300));
    got.sort();
    assert_eq!(got, ["first", "windowed"]);
    // Its dependency done, a dependent is waiting at once: a wake-up; blocked, none is
    // needed but one costs only an empty claim.
    let claimed = jobs::claim(&mut conn, "first", 1, Duration::from_secs(60)).unwrap();
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    received(&mut listen, Duration::from_millis(200));
    jobs::enqueue(
        &mut conn,
        &NewJob::new("after", "k", vec![]).depends_on([first]),
    )
    .unwrap();
    let got = received(&mut listen, Duration::from_millis(300));
    assert!(
        !got.is_empty() && got.iter().all(|q| q == "after"),
        "woken for {got:?}"
    );
}

#[test]
fn an_enqueue_folded_into_a_live_job_wakes_nobody() {
    let db = TestDb::migrated(Backend::Postgres);
    let mut listen = listener(&db);
    let mut conn = db.connect();
    let keyed = NewJob::new("mail", "send", vec![]).dedup_key("once");
    jobs::enqueue(&mut conn, &keyed).unwrap();
    assert_eq!(received(&mut listen, Duration::from_millis(300)), ["mail"]);
    let again = jobs::enqueue(&mut conn, &keyed).unwrap();
    assert!(again.existing);
    assert_eq!(
        received(&mut listen, Duration::from_millis(300)),
        Vec::<String>::new()
    );
}

/// The wake-up after an enqueue's commit is sent in a transaction whose commit does not wait
/// for the disk; that setting is the notifying transaction's alone: the connection's next
/// transactions (the caller's) are as durable as before.
#[test]
fn the_unflushed_wake_up_leaves_the_sessions_durability_alone() {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    let db = TestDb::migrated(Backend::Postgres);
    let mut listen = listener(&db);
    let mut conn = db.connect();
    jobs::enqueue(&mut conn, &NewJob::new("mail", "send", vec![])).unwrap();
    jobs::enqueue_many(&mut conn, &[NewJob::new("mail", "send", vec![])]).unwrap();
    let setting = diesel::sql_query("SELECT current_setting('synchronous_commit') AS value")
        .get_result::<Setting>(pg(&mut conn))
        .unwrap()
        .value;
    assert_eq!(setting, "on");
    assert_eq!(
        received(&mut listen, Duration::from_millis(300)),
        ["mail", "mail"]
    );
}

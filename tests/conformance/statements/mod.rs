//! tenure's statements are prepared once per connection: while a worker drains, preparing stays
//! flat after warm-up and executing grows (diesel's events on every backend; the server's own
//! per-session counters on PostgreSQL and MariaDB).

mod reuse;
mod shapes;

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use diesel::connection::{Instrumentation, InstrumentationEvent, set_default_instrumentation};
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, Worker};
use tenure::{Backend, TenureConnection};

use crate::common::{TestDb, concrete, conformance, wait_for};

conformance!(a_draining_worker_prepares_each_statement_once);

/// Statements diesel put in a connection's cache (each prepared once there).
static CACHED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
/// Statements started, and those of them never cached (prepared at every execution).
static STARTED: AtomicU64 = AtomicU64::new(0);
static UNCACHED: AtomicU64 = AtomicU64::new(0);
static NEWLY_CACHED: AtomicU64 = AtomicU64::new(0);

fn sql_of(query: &str) -> String {
    query
        .split(" -- binds:")
        .next()
        .unwrap_or(query)
        .trim()
        .to_string()
}

/// Transaction control, and MariaDB's ring rotation's session timeout, table lock and
/// truncate, go as simple statements, never prepared: not counted.
fn is_simple_statement(sql: &str) -> bool {
    let upper = sql.trim_start().to_ascii_uppercase();
    [
        "BEGIN",
        "COMMIT",
        "ROLLBACK",
        "SAVEPOINT",
        "RELEASE",
        "SET TRANSACTION",
        "SET SESSION WAIT_TIMEOUT",
        "LOCK TABLES",
        "UNLOCK TABLES",
        "ALTER TABLE TENURE_READY TRUNCATE PARTITION",
    ]
    .iter()
    .any(|p| upper.starts_with(p))
}

fn counting() -> Option<Box<dyn Instrumentation>> {
    Some(Box::new(|event: InstrumentationEvent<'_>| match event {
        InstrumentationEvent::CacheQuery { sql, .. } => {
            NEWLY_CACHED.fetch_add(1, Ordering::SeqCst);
            let mut cached = CACHED.lock().unwrap();
            cached
                .get_or_insert_with(HashSet::new)
                .insert(sql.to_string());
        }
        InstrumentationEvent::StartQuery { query, .. } => {
            let sql = sql_of(&query.to_string());
            if is_simple_statement(&sql) {
                return;
            }
            STARTED.fetch_add(1, Ordering::SeqCst);
            let cached = CACHED.lock().unwrap();
            // A cached statement is announced (CacheQuery) before it starts.
            if !cached.as_ref().is_some_and(|c| c.contains(&sql)) {
                UNCACHED.fetch_add(1, Ordering::SeqCst);
            }
        }
        _ => {}
    }))
}

/// (statements started, of them never cached, newly cached) so far.
fn events() -> (u64, u64, u64) {
    (
        STARTED.load(Ordering::SeqCst),
        UNCACHED.load(Ordering::SeqCst),
        NEWLY_CACHED.load(Ordering::SeqCst),
    )
}

#[derive(QueryableByName, Debug)]
struct Counters {
    // Shown in failure messages.
    #[allow(dead_code)]
    #[diesel(sql_type = BigInt)]
    session: i64,
    #[diesel(sql_type = BigInt)]
    prepared: i64,
    #[diesel(sql_type = BigInt)]
    executed: i64,
}

/// The server's own per-session counters of one connection: on PostgreSQL the statements it
/// holds prepared and how often they ran (plans made: one per execution); on MariaDB the
/// session's `Com_stmt_prepare` and `Com_stmt_execute` (this query itself adds one of each).
fn server_counters(conn: &mut tenure::PooledConnection) -> Option<Counters> {
    let sql = match conn.backend() {
        Backend::Sqlite => return None,
        Backend::Postgres => {
            "SELECT CAST(pg_backend_pid() AS BIGINT) AS session, \
             CAST(COUNT(*) AS BIGINT) AS prepared, \
             CAST(COALESCE(SUM(generic_plans + custom_plans), 0) AS BIGINT) AS executed \
             FROM pg_prepared_statements"
        }
        Backend::Mysql => {
            "SELECT CAST(CONNECTION_ID() AS SIGNED) AS session, \
             (SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.SESSION_STATUS \
              WHERE VARIABLE_NAME = 'COM_STMT_PREPARE') AS prepared, \
             (SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.SESSION_STATUS \
              WHERE VARIABLE_NAME = 'COM_STMT_EXECUTE') AS executed"
        }
    };
    Some(concrete!(&mut **conn, c => diesel::sql_query(sql).get_result::<Counters>(c).unwrap()))
}

fn a_draining_worker_prepares_each_statement_once(backend: Backend) {
    const ROUND: usize = 1000;
    set_default_instrumentation(counting).unwrap();
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let worker = Worker::builder(pool.clone())
        .queue("prepared")
        .threads(2)
        .poll_interval(Duration::from_millis(20))
        .handler("noop", |_: &JobContext, _: u32| Ok(()))
        .start()
        .unwrap();
    let mut rounds = Vec::new();
    for round in 1..=3 {
        let before = events();
        let batch: Vec<NewJob> = (0..ROUND as u32)
            .map(|i| NewJob::json("prepared", "noop", &i).unwrap())
            .collect();
        // Single enqueues too, so their statements are measured.
        let mut conn = pool.get().unwrap();
        jobs::enqueue_many(&mut conn, &batch[..ROUND - 100]).unwrap();
        for job in &batch[ROUND - 100..] {
            jobs::enqueue(&mut conn, job).unwrap();
        }
        drop(conn);
        let report = wait_for(&worker, Duration::from_secs(120), |r| {
            r.completed >= round * ROUND
        });
        assert_eq!(report.completed, round * ROUND, "round {round}: {report:?}");
        let after = events();
        rounds.push((after.0 - before.0, after.1 - before.1, after.2 - before.2));
    }
    worker.shutdown(Duration::from_secs(10));
    eprintln!("{backend}: per round (started, of them uncached, newly cached): {rounds:?}");
    let (started, uncached, newly_cached) = rounds[2];
    // Executing grows: the third round ran at least one statement per 10 jobs...
    assert!(started >= (ROUND / 10) as u64, "{rounds:?}");
    // ...and preparing stays flat. A statement cached for the first time is counted as
    // uncached at its start: what is left was prepared and thrown away, which only the
    // multi-row insert may be (its text changes with its row count; one a round here).
    // (A statement started uncached at the very end of round 2 may be counted as newly
    // cached in round 3, so the difference can be negative under load.)
    assert!(
        uncached.saturating_sub(newly_cached) <= 2,
        "{backend}: third round ran {} statements diesel did not keep prepared: {rounds:?}",
        uncached.saturating_sub(newly_cached)
    );
    // New shapes of an id list may still be met (at most 6 per statement, ever).
    assert!(
        newly_cached * 10 <= started,
        "{backend}: third round prepared {newly_cached} new statements: {rounds:?}"
    );

    if backend == Backend::Sqlite {
        return;
    }
    // The server agrees: on every connection the worker used, far more executions than
    // prepares.
    let mut held = Vec::new();
    let mut sessions = Vec::new();
    for _ in 0..pool.r2d2().state().connections {
        let mut conn = pool.get().unwrap();
        sessions.push(server_counters(&mut conn).unwrap());
        held.push(conn);
    }
    eprintln!("{backend}: server counters per connection: {sessions:?}");
    let prepared: i64 = sessions.iter().map(|s| s.prepared).sum();
    let executed: i64 = sessions.iter().map(|s| s.executed).sum();
    assert!(
        executed >= 3 * ROUND as i64 / 10,
        "{backend}: {executed} executions on the server: {sessions:?}"
    );
    assert!(
        prepared * 5 <= executed,
        "{backend}: {prepared} prepares for {executed} executions: {sessions:?}"
    );
}

//! Errors say what a caller can do: lock conflicts are retryable, other errors are not, an
//! unreachable server is a fast typed error, a lost connection is outcome-unknown.

use std::time::{Duration, Instant as Clock};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::{AnyConnection, Backend, Error};

use super::insert_lease_row;
use crate::common::{TestDb, concrete, conformance, placeholders, race};

conformance!(
    lock_conflicts_are_retryable,
    other_errors_are_not_retryable,
    unreachable_server_is_a_fast_typed_error,
);

/// Two connections lock two rows in opposite orders: the server must break the deadlock, and
/// the victim's error must say "retry".
fn provoke_deadlock(db: &TestDb) -> Error {
    let mut setup = db.connect();
    setup
        .batch_execute(
            "CREATE TABLE dl (id INTEGER PRIMARY KEY, v INTEGER NOT NULL); \
             INSERT INTO dl (id, v) VALUES (1, 0); INSERT INTO dl (id, v) VALUES (2, 0);",
        )
        .unwrap();
    let outcomes = race(db, 2, |i, conn| {
        let (first, second) = if i == 0 { (1, 2) } else { (2, 1) };
        conn.transaction(|c| {
            c.batch_execute(&format!("UPDATE dl SET v = v + 1 WHERE id = {first}"))?;
            std::thread::sleep(Duration::from_millis(300));
            c.batch_execute(&format!("UPDATE dl SET v = v + 1 WHERE id = {second}"))?;
            Ok::<_, Error>(())
        })
    });
    let errors: Vec<Error> = outcomes.into_iter().filter_map(Result::err).collect();
    assert_eq!(errors.len(), 1, "exactly one deadlock victim: {errors:?}");
    errors.into_iter().next().unwrap()
}

fn lock_conflicts_are_retryable(backend: Backend) {
    let db = TestDb::empty(backend);
    match backend {
        Backend::Sqlite => {
            let mut a = db.connect();
            let mut b = db.connect();
            a.batch_execute("CREATE TABLE busy (id INTEGER)").unwrap();
            b.batch_execute("PRAGMA busy_timeout = 0").unwrap();
            a.batch_execute("BEGIN IMMEDIATE").unwrap();
            let err: Error = b
                .batch_execute("INSERT INTO busy (id) VALUES (1)")
                .unwrap_err()
                .into();
            assert!(err.is_retryable(), "SQLITE_BUSY: {err:?}");
            assert!(!err.is_outcome_unknown());
            a.batch_execute("COMMIT").unwrap();
        }
        Backend::Postgres | Backend::Mysql => {
            let deadlock = provoke_deadlock(&db);
            assert!(deadlock.is_retryable(), "deadlock: {deadlock:?}");
            // A lock wait that times out.
            let mut holder = db.connect();
            let mut waiter = db.connect();
            waiter
                .batch_execute(if backend == Backend::Postgres {
                    "SET lock_timeout = '200ms'"
                } else {
                    "SET SESSION innodb_lock_wait_timeout = 1"
                })
                .unwrap();
            holder
                .transaction(|h| {
                    h.batch_execute("UPDATE dl SET v = 10 WHERE id = 1")?;
                    let err: Error = waiter
                        .transaction(|w| w.batch_execute("UPDATE dl SET v = 20 WHERE id = 1"))
                        .unwrap_err()
                        .into();
                    assert!(err.is_retryable(), "lock timeout: {err:?}");
                    Ok::<_, Error>(())
                })
                .unwrap();
        }
    }
}

fn other_errors_are_not_retryable(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let now = tenure::database_now(&mut conn).unwrap();
    insert_lease_row(&mut conn, "dup", 1, now);
    let sql = format!(
        "INSERT INTO tenure_leases (name, holder, fence, acquired_at, expires_at, reusable_at) VALUES ({})",
        placeholders(backend, 6)
    );
    let dup: Error = concrete!(&mut conn, c => diesel::sql_query(sql)
        .bind::<Text, _>("dup")
        .bind::<Text, _>("x")
        .bind::<BigInt, _>(2)
        .bind::<tenure::sql_types::Instant, _>(now)
        .bind::<tenure::sql_types::Instant, _>(now)
        .bind::<tenure::sql_types::Instant, _>(now)
        .execute(c))
    .unwrap_err()
    .into();
    assert!(!dup.is_retryable() && !dup.is_outcome_unknown(), "{dup:?}");
    let syntax: Error = conn.batch_execute("SELEC 1").unwrap_err().into();
    assert!(
        !syntax.is_retryable() && !syntax.is_outcome_unknown(),
        "{syntax:?}"
    );
}

fn unreachable_server_is_a_fast_typed_error(backend: Backend) {
    let unreachable = match backend {
        Backend::Postgres => "postgres://root:s3cret@127.0.0.1:1/test".to_string(),
        Backend::Mysql => "mysql://root:s3cret@127.0.0.1:1/test".to_string(),
        Backend::Sqlite => "/nonexistent-dir-s3cret/tenure.db".to_string(),
    };
    for attempt in ["connect", "pool"] {
        let started = Clock::now();
        let err = match attempt {
            "connect" => AnyConnection::connect(&unreachable).map(drop).unwrap_err(),
            _ => tenure::Pool::open(&unreachable).map(drop).unwrap_err(),
        };
        let took = started.elapsed();
        assert!(
            matches!(&err, Error::Connect { backend: b, .. } if *b == backend),
            "{attempt}: {err:?}"
        );
        // Refused at once on loopback; 10x margin over a slow machine's worst case.
        assert!(took < Duration::from_secs(5), "{attempt} took {took:?}");
        if backend != Backend::Sqlite {
            assert!(!format!("{err} {err:?}").contains("s3cret"), "{err}");
        }
    }
    if backend != Backend::Sqlite {
        // A reachable server's own refusal comes through with its message.
        let mut url = url::Url::parse(&crate::common::server_url(backend)).unwrap();
        url.set_path("tenure_no_such_database");
        let err = AnyConnection::connect(url.as_str()).map(drop).unwrap_err();
        assert!(matches!(err, Error::Connect { .. }), "{err:?}");
        assert!(err.to_string().contains("tenure_no_such_database"), "{err}");
    }
}

/// A connection the server drops mid-session: the next call's error says "outcome unknown"
/// (SQLite runs in-process and has no connection to lose).
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn lost_connection_is_outcome_unknown(backend: Backend) {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let db = TestDb::empty(backend);
    let mut victim = db.connect();
    let mut admin = db.connect();
    let (who, kill) = match backend {
        Backend::Postgres => (
            "SELECT CAST(pg_backend_pid() AS BIGINT) AS id",
            "SELECT pg_terminate_backend({})",
        ),
        _ => ("SELECT CAST(CONNECTION_ID() AS SIGNED) AS id", "KILL {}"),
    };
    let id = diesel::sql_query(who)
        .get_result::<Id>(&mut victim)
        .unwrap()
        .id;
    admin
        .batch_execute(&kill.replace("{}", &id.to_string()))
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let err: Error = victim.batch_execute("SELECT 1").unwrap_err().into();
    assert!(err.is_outcome_unknown(), "{err:?}");
    assert!(!err.is_retryable(), "{err:?}");
}

#[cfg(feature = "postgres")]
mod postgres_only {
    #[test]
    fn lost_connection_is_outcome_unknown() {
        super::lost_connection_is_outcome_unknown(tenure::Backend::Postgres)
    }
}

#[cfg(feature = "mysql")]
mod mysql_only {
    #[test]
    fn lost_connection_is_outcome_unknown() {
        super::lost_connection_is_outcome_unknown(tenure::Backend::Mysql)
    }
}

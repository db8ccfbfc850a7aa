//! The foundation: migrations, names, time, transactions, errors and connecting.

use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};
use tenure::{AnyConnection, Backend, BackendConnection, Error, TenureConnection};

use crate::common::{
    TestDb, concrete, conformance, count, instant_column, placeholders, race, token_column,
};

conformance!(
    migrations_apply_once_and_are_idempotent,
    migrations_are_safe_from_four_threads_at_once,
    migrations_live_beside_a_users_own_set,
    migrations_refuse_an_open_transaction,
    migrations_refuse_a_database_of_the_former_name,
    names_are_byte_exact,
    clock_is_utc_in_a_non_utc_session,
    instants_and_tokens_round_trip,
    transaction_helper_opens_the_right_kind,
    transaction_helper_nests_as_a_savepoint,
    lock_conflicts_are_retryable,
    other_errors_are_not_retryable,
    unreachable_server_is_a_fast_typed_error,
    pool_applies_session_settings,
);

#[cfg(feature = "sqlite")]
const USER_SQLITE: EmbeddedMigrations = embed_migrations!("tests/user_migrations/sqlite");
#[cfg(feature = "postgres")]
const USER_POSTGRES: EmbeddedMigrations = embed_migrations!("tests/user_migrations/postgres");
#[cfg(feature = "mysql")]
const USER_MYSQL: EmbeddedMigrations = embed_migrations!("tests/user_migrations/mysql");

/// Runs the user's own migration set on whatever backend `conn` is.
fn run_user_migrations(conn: &mut AnyConnection) -> Vec<String> {
    let versions = match conn.backend_connection() {
        #[cfg(feature = "sqlite")]
        BackendConnection::Sqlite(c) => c.run_pending_migrations(USER_SQLITE).map(strings),
        #[cfg(feature = "postgres")]
        BackendConnection::Postgres(c) => c.run_pending_migrations(USER_POSTGRES).map(strings),
        #[cfg(feature = "mysql")]
        BackendConnection::Mysql(c) => c.run_pending_migrations(USER_MYSQL).map(strings),
        #[allow(unreachable_patterns)]
        _ => unreachable!(),
    };
    versions.expect("the user's migrations")
}

fn strings(v: Vec<diesel::migration::MigrationVersion<'_>>) -> Vec<String> {
    v.into_iter().map(|v| v.to_string()).collect()
}

fn recorded_versions(conn: &mut AnyConnection) -> Vec<String> {
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = Text)]
        version: String,
    }
    diesel::sql_query("SELECT version FROM __diesel_schema_migrations ORDER BY version")
        .load::<V>(conn)
        .expect("read diesel's migration table")
        .into_iter()
        .map(|v| v.version)
        .collect()
}

fn migrations_apply_once_and_are_idempotent(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut conn = db.connect();
    assert_eq!(tenure::schema_version(&mut conn).unwrap(), None);
    let applied = tenure::run_migrations(&mut conn).unwrap();
    assert!(!applied.is_empty());
    assert!(
        applied
            .iter()
            .all(|v| v.starts_with(tenure::VERSION_PREFIX))
    );
    assert_eq!(
        tenure::run_migrations(&mut conn).unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        tenure::schema_version(&mut conn).unwrap().as_ref(),
        applied.last()
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_leases"),
        0
    );
    assert_eq!(recorded_versions(&mut conn), applied);
}

fn migrations_are_safe_from_four_threads_at_once(backend: Backend) {
    for _round in 0..3 {
        let db = TestDb::empty(backend);
        let results = race(&db, 4, |_, conn| tenure::run_migrations(conn));
        let mut all: Vec<String> = Vec::new();
        for result in results {
            all.extend(result.expect("every concurrent migrator succeeds"));
        }
        all.sort();
        let mut conn = db.connect();
        // Each version was applied by exactly one of the four, and recorded once.
        assert_eq!(all, recorded_versions(&mut conn));
        assert!(!all.is_empty());
    }
}

fn migrations_live_beside_a_users_own_set(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut conn = db.connect();
    assert_eq!(run_user_migrations(&mut conn), vec!["20240101000000"]);
    let ours = tenure::run_migrations(&mut conn).unwrap();
    assert!(!ours.is_empty());
    // Neither set mistakes the other's versions for its own.
    assert!(run_user_migrations(&mut conn).is_empty());
    assert!(tenure::run_migrations(&mut conn).unwrap().is_empty());
    let mut expected = ours.clone();
    expected.push("20240101000000".to_string());
    expected.sort();
    assert_eq!(recorded_versions(&mut conn), expected);
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM widgets"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_leases"),
        0
    );
}

fn migrations_refuse_an_open_transaction(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut conn = db.connect();
    let err = conn
        .transaction(tenure::run_migrations)
        .expect_err("migrations inside a transaction");
    assert!(
        matches!(
            err,
            Error::InTransaction {
                operation: "run_migrations"
            }
        ),
        "{err:?}"
    );
    let err = tenure::transaction(&mut conn, tenure::run_migrations).unwrap_err();
    assert!(matches!(err, Error::InTransaction { .. }), "{err:?}");
    // Nothing was applied, and the connection is usable afterwards.
    assert_eq!(tenure::schema_version(&mut conn).unwrap(), None);
    assert!(!tenure::run_migrations(&mut conn).unwrap().is_empty());
}

/// A database migrated under the crate's former name gets an error that says what to do, and
/// no second set of tables beside its own.
fn migrations_refuse_a_database_of_the_former_name(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut conn = db.connect();
    conn.batch_execute(
        "CREATE TABLE __diesel_schema_migrations (version VARCHAR(50) PRIMARY KEY NOT NULL, \
         run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .unwrap();
    conn.batch_execute(
        "INSERT INTO __diesel_schema_migrations (version) VALUES ('dibs-0001_create_leases')",
    )
    .unwrap();
    let err = tenure::run_migrations(&mut conn).expect_err("a database of the former name");
    let message = err.to_string();
    assert!(matches!(err, Error::Migration(_)), "{err:?}");
    assert!(message.contains("former name"), "{message}");
    assert!(message.contains("drop the dibs_* tables"), "{message}");
    assert_eq!(
        recorded_versions(&mut conn),
        vec!["dibs-0001_create_leases"]
    );
    assert_eq!(tenure::schema_version(&mut conn).unwrap(), None);
    let created = diesel::sql_query("SELECT COUNT(*) AS n FROM tenure_leases").execute(&mut conn);
    assert!(created.is_err(), "no tenure table was created");
}

fn names_are_byte_exact(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let now = tenure::database_now(&mut conn).unwrap();
    for (i, name) in ["Job", "job", "job ", "jöb", "JOB"].iter().enumerate() {
        insert_lease_row(&mut conn, name, i as i64, now);
    }
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_leases"),
        5
    );
    for (i, name) in ["Job", "job", "job ", "jöb", "JOB"].iter().enumerate() {
        let fences = fences_named(&mut conn, name);
        assert_eq!(fences, vec![i as i64], "lookup of {name:?}");
    }
    assert!(fences_named(&mut conn, "jo").is_empty());
}

fn insert_lease_row(conn: &mut AnyConnection, name: &str, fence: i64, at: DateTime<Utc>) {
    let backend = conn.backend();
    let sql = format!(
        "INSERT INTO tenure_leases (name, holder, fence, acquired_at, expires_at) VALUES ({})",
        placeholders(backend, 5)
    );
    concrete!(conn, c => diesel::sql_query(sql)
        .bind::<Text, _>(name)
        .bind::<Text, _>("test")
        .bind::<BigInt, _>(fence)
        .bind::<tenure::sql_types::Instant, _>(at)
        .bind::<tenure::sql_types::Instant, _>(at)
        .execute(c))
    .expect("insert a lease row");
}

fn fences_named(conn: &mut AnyConnection, name: &str) -> Vec<i64> {
    #[derive(QueryableByName)]
    struct F {
        #[diesel(sql_type = BigInt)]
        fence: i64,
        #[diesel(sql_type = Text)]
        name: String,
    }
    let backend = conn.backend();
    let rows = diesel::sql_query(format!(
        "SELECT fence, name FROM tenure_leases WHERE name = {}",
        placeholders(backend, 1)
    ))
    .bind::<Text, _>(name)
    .load::<F>(conn)
    .expect("look a lease up by name");
    for row in &rows {
        assert_eq!(row.name, name, "names come back byte for byte");
    }
    rows.into_iter().map(|r| r.fence).collect()
}

fn set_non_utc_session(conn: &mut AnyConnection) {
    match conn.backend() {
        Backend::Postgres => conn.batch_execute("SET TIME ZONE 'Pacific/Chatham'"),
        Backend::Mysql => conn.batch_execute("SET time_zone = '+05:30'"),
        // SQLite has no session time zone: 'now' is UTC whatever TZ the process has.
        Backend::Sqlite => Ok(()),
    }
    .expect("set a non-UTC session time zone");
}

fn clock_is_utc_in_a_non_utc_session(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut conn = db.connect_raw();
    set_non_utc_session(&mut conn);
    let before = Utc::now();
    let db_now = tenure::database_now(&mut conn).unwrap();
    let after = Utc::now();
    // Same host: the database's UTC clock falls between two readings of ours (1 s of slack
    // for SQLite's and MariaDB's rounding).
    assert!(
        db_now > before - chrono::Duration::seconds(1)
            && db_now < after + chrono::Duration::seconds(1),
        "database now {db_now} is not between {before} and {after}"
    );
    // And it moves: two readings 50 ms apart differ (PostgreSQL's now() would not, inside a
    // transaction; statement_timestamp() does).
    let in_tx = conn
        .transaction(|c| {
            let a = tenure::database_now(c)?;
            std::thread::sleep(Duration::from_millis(50));
            let b = tenure::database_now(c)?;
            Ok::<_, Error>((a, b))
        })
        .unwrap();
    assert!(
        in_tx.1 - in_tx.0 >= chrono::Duration::milliseconds(40),
        "{in_tx:?}"
    );
}

fn instants_and_tokens_round_trip(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut utc = db.connect();
    let mut other = db.connect_raw();
    set_non_utc_session(&mut other);
    utc.batch_execute(&format!(
        "CREATE TABLE rt (id INTEGER PRIMARY KEY, at {}, token {})",
        instant_column(backend),
        token_column(backend)
    ))
    .unwrap();
    let precise: DateTime<Utc> = "2031-07-04T23:59:58.123456Z".parse().unwrap();
    let token = uuid::Uuid::new_v4();
    let sql = format!(
        "INSERT INTO rt (id, at, token) VALUES ({})",
        placeholders(backend, 3)
    );
    concrete!(&mut other, c => diesel::sql_query(sql)
        .bind::<diesel::sql_types::Integer, _>(1)
        .bind::<tenure::sql_types::Instant, _>(precise)
        .bind::<tenure::sql_types::Token, _>(token)
        .execute(c))
    .unwrap();

    #[derive(QueryableByName, Debug, PartialEq)]
    struct Row {
        #[diesel(sql_type = tenure::sql_types::Instant)]
        at: DateTime<Utc>,
        #[diesel(sql_type = tenure::sql_types::Token)]
        token: uuid::Uuid,
    }
    let expected_at = match backend {
        // SQLite's instants have milliseconds.
        Backend::Sqlite => "2031-07-04T23:59:58.123Z".parse().unwrap(),
        _ => precise,
    };
    for conn in [&mut utc, &mut other] {
        let row: Row =
            concrete!(conn, c => diesel::sql_query("SELECT at, token FROM rt WHERE id = 1")
            .get_result(c))
            .unwrap();
        assert_eq!(
            row,
            Row {
                at: expected_at,
                token
            }
        );
    }
}

fn transaction_helper_opens_the_right_kind(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut a = db.connect();
    a.batch_execute("CREATE TABLE tk (id INTEGER PRIMARY KEY)")
        .unwrap();
    match backend {
        Backend::Sqlite => {
            // IMMEDIATE: the write lock is taken at BEGIN, before any write, so a second
            // writer with no busy timeout is refused at once.
            let mut b = db.connect();
            b.batch_execute("PRAGMA busy_timeout = 0").unwrap();
            tenure::transaction(&mut a, |_| {
                let err = tenure::transaction(&mut b, |_| Ok::<_, Error>(())).unwrap_err();
                assert!(err.is_retryable(), "{err:?}");
                Ok::<_, Error>(())
            })
            .unwrap();
        }
        Backend::Postgres | Backend::Mysql => {
            // READ COMMITTED: a row another connection commits mid-transaction is seen by the
            // next statement (REPEATABLE READ, MySQL's default, would keep the old snapshot).
            let mut b = db.connect();
            let seen = tenure::transaction(&mut a, |a| {
                let first = count(a, "SELECT COUNT(*) AS n FROM tk");
                b.batch_execute("INSERT INTO tk (id) VALUES (1)")?;
                let second = count(a, "SELECT COUNT(*) AS n FROM tk");
                Ok::<_, Error>((first, second))
            })
            .unwrap();
            assert_eq!(seen, (0, 1));
        }
    }
}

fn transaction_helper_nests_as_a_savepoint(backend: Backend) {
    let db = TestDb::empty(backend);
    let mut conn = db.connect();
    conn.batch_execute("CREATE TABLE tn (id INTEGER PRIMARY KEY)")
        .unwrap();
    let outer: Result<(), Error> = tenure::transaction(&mut conn, |c| {
        c.batch_execute("INSERT INTO tn (id) VALUES (1)")?;
        let inner: Result<(), Error> = tenure::transaction(c, |c| {
            c.batch_execute("INSERT INTO tn (id) VALUES (2)")?;
            Err(Error::Timeout { what: "nothing" })
        });
        assert!(inner.is_err());
        Ok(())
    });
    outer.unwrap();
    // The inner rollback undid only its own row.
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tn"), 1);
    // A failing closure rolls the whole transaction back.
    let failed: Result<(), Error> = tenure::transaction(&mut conn, |c| {
        c.batch_execute("INSERT INTO tn (id) VALUES (3)")?;
        Err(Error::Timeout { what: "nothing" })
    });
    assert!(failed.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tn"), 1);
}

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
        "INSERT INTO tenure_leases (name, holder, fence, acquired_at, expires_at) VALUES ({})",
        placeholders(backend, 5)
    );
    let dup: Error = concrete!(&mut conn, c => diesel::sql_query(sql)
        .bind::<Text, _>("dup")
        .bind::<Text, _>("x")
        .bind::<BigInt, _>(2)
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

fn pool_applies_session_settings(backend: Backend) {
    let db = TestDb::empty(backend);
    let pool = db.pool(2);
    assert_eq!(pool.backend(), backend);
    let mut conn = pool.get().unwrap();
    #[derive(QueryableByName)]
    struct S {
        #[diesel(sql_type = Text)]
        s: String,
    }
    let get = |conn: &mut tenure::PooledConnection, sql: &str| -> String {
        diesel::sql_query(sql)
            .get_result::<S>(&mut **conn)
            .unwrap()
            .s
    };
    match backend {
        Backend::Sqlite => {
            assert_eq!(
                get(
                    &mut conn,
                    "SELECT journal_mode AS s FROM pragma_journal_mode"
                ),
                "wal"
            );
            assert_eq!(
                count(&mut conn, "SELECT synchronous AS n FROM pragma_synchronous"),
                2
            );
            assert_eq!(
                count(&mut conn, "SELECT timeout AS n FROM pragma_busy_timeout"),
                5000
            );
            let err = tenure::Pool::open(":memory:").unwrap_err();
            assert!(err.is_invalid_input(), "{err:?}");
        }
        Backend::Mysql => {
            assert_eq!(get(&mut conn, "SELECT @@session.time_zone AS s"), "+00:00");
            assert!(get(&mut conn, "SELECT @@session.sql_mode AS s").contains("STRICT_ALL_TABLES"));
        }
        Backend::Postgres => {}
    }
    // The pooled connection is a TenureConnection itself, and holds tenure's transactions.
    tenure::run_migrations(&mut conn).unwrap();
    let now = tenure::transaction(&mut conn, tenure::database_now).unwrap();
    assert!((Utc::now() - now).num_seconds().abs() < 5);
    assert!(tenure::schema_version(&mut conn).unwrap().is_some());
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

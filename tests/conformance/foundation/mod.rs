//! The foundation: names, time, transactions and the pool's session settings; migrations,
//! errors, the pool's reconnection and what replication the server has in files of their own.

mod errors;
mod migrations;
mod reconnects;
mod replication;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::{AnyConnection, Backend, Error, TenureConnection};

use crate::common::{
    TestDb, concrete, conformance, count, instant_column, placeholders, token_column,
};

conformance!(
    names_are_byte_exact,
    clock_is_utc_in_a_non_utc_session,
    instants_and_tokens_round_trip,
    transaction_helper_opens_the_right_kind,
    transaction_helper_nests_as_a_savepoint,
    pool_applies_session_settings,
);

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
        "INSERT INTO tenure_leases (name, holder, fence, acquired_at, expires_at, reusable_at) VALUES ({})",
        placeholders(backend, 6)
    );
    concrete!(conn, c => diesel::sql_query(sql)
        .bind::<Text, _>(name)
        .bind::<Text, _>("test")
        .bind::<BigInt, _>(fence)
        .bind::<tenure::sql_types::Instant, _>(at)
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

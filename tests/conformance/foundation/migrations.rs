//! tenure's migrations: applied once, safe from four threads at once, beside a user's own set,
//! refused inside a transaction and on a database of the crate's former name.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};
use tenure::{AnyConnection, Backend, BackendConnection, Error, TenureConnection};

use crate::common::{TestDb, conformance, count, race};

conformance!(
    migrations_apply_once_and_are_idempotent,
    migrations_are_safe_from_four_threads_at_once,
    migrations_live_beside_a_users_own_set,
    migrations_refuse_an_open_transaction,
    migrations_refuse_a_database_of_the_former_name,
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

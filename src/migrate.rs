//! tenure's schema: embedded migrations per backend, run under a lock.

use diesel::backend::Backend as DieselBackend;
use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::backend::transaction::in_transaction;
use crate::backend::{Dialect, dispatch};
use crate::rows::Count;
use crate::{Backend, Error, Result, TenureConnection};

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");
#[cfg(feature = "mysql")]
pub(crate) const MYSQL: EmbeddedMigrations = embed_migrations!("migrations/mysql");

/// Every version tenure records in `__diesel_schema_migrations` starts with this, so it cannot
/// collide with a user's own versions (diesel's are timestamps or numbers).
pub const VERSION_PREFIX: &str = "tenure";

/// Runs tenure's pending migrations on any backend and returns the versions it applied (empty
/// when the schema is current).
///
/// It shares diesel's `__diesel_schema_migrations` table with your own migrations: tenure's
/// versions all start with `tenure`, and each set only runs its own. Several processes may run
/// it at once: PostgreSQL serializes them with an advisory lock (and applies the whole set in
/// one transaction), MySQL/MariaDB with `GET_LOCK` (one DDL statement per step, since DDL
/// commits implicitly there), SQLite with an IMMEDIATE transaction.
///
/// Needs a connection outside any transaction ([`Error::InTransaction`] otherwise).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// assert!(!tenure::run_migrations(&mut conn)?.is_empty());
/// assert!(tenure::run_migrations(&mut conn)?.is_empty());
/// # Ok(()) }
/// ```
pub fn run_migrations<C: TenureConnection>(conn: &mut C) -> Result<Vec<String>> {
    // A database migrated under the crate's former name holds its tables under other names:
    // migrating it would silently add a second, empty set beside them.
    if in_transaction(conn) {
        return Err(Error::InTransaction {
            operation: "run_migrations",
        });
    }
    if recorded_versions(conn)?
        .iter()
        .any(|v| v.starts_with(FORMER_VERSION_PREFIX))
    {
        return Err(Error::Migration(FORMER_NAME_FOUND.to_owned()));
    }
    dispatch!(conn, c => c.migrate())
}

/// The prefix of the versions recorded by this crate under its former name.
const FORMER_VERSION_PREFIX: &str = "dibs";

/// What [`run_migrations`] says of a database migrated under the former name.
const FORMER_NAME_FOUND: &str = "this database was migrated by `dibs`, this crate's former name: \
its tables are named dibs_* and its versions in __diesel_schema_migrations start with `dibs`. \
tenure does not take them over. Use a new database, or drain the old queue with the old \
version, then drop the dibs_* tables and delete the rows of __diesel_schema_migrations whose \
version starts with `dibs`, and run the migrations again";

/// The newest tenure migration applied to this database, or `None` before the first
/// [`run_migrations`].
///
/// It only reads: on a database without diesel's `__diesel_schema_migrations` table it says
/// `None` and creates nothing, so it can run at the same time as [`run_migrations`] (a
/// `tenure work` starting while `tenure migrate` runs). Inside a caller's transaction it is a
/// plain read of it.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// assert_eq!(tenure::schema_version(&mut conn)?, None);
/// tenure::run_migrations(&mut conn)?;
/// assert!(tenure::schema_version(&mut conn)?.unwrap().starts_with("tenure"));
/// # Ok(()) }
/// ```
pub fn schema_version<C: TenureConnection>(conn: &mut C) -> Result<Option<String>> {
    Ok(recorded_versions(conn)?
        .into_iter()
        .filter(|v| v.starts_with(VERSION_PREFIX))
        .max())
}

/// Every version in diesel's `__diesel_schema_migrations`, or none when it does not exist.
fn recorded_versions<C: TenureConnection>(conn: &mut C) -> Result<Vec<String>> {
    // Asking diesel's harness would create its table when it is missing (CREATE TABLE IF NOT
    // EXISTS), and on PostgreSQL two of those at once fail on pg_type's unique index, even
    // with IF NOT EXISTS: that raced `run_migrations`, which creates it under its lock.
    let table_exists = match conn.backend() {
        Backend::Sqlite => {
            "SELECT COUNT(*) AS n FROM sqlite_master \
             WHERE type = 'table' AND name = '__diesel_schema_migrations'"
        }
        // Resolved through search_path, like diesel's own unqualified statements.
        Backend::Postgres => {
            "SELECT CAST(COUNT(*) AS BIGINT) AS n \
             FROM (SELECT to_regclass('__diesel_schema_migrations') AS t) r WHERE t IS NOT NULL"
        }
        Backend::Mysql => {
            "SELECT COUNT(*) AS n FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = '__diesel_schema_migrations'"
        }
    };
    let versions: Vec<Version> = dispatch!(conn, c => {
        let exists = crate::backend::statement::statement(table_exists).get_result::<Count>(c)?.n > 0;
        if exists {
            crate::backend::statement::statement("SELECT version FROM __diesel_schema_migrations").load::<Version>(c)
        } else {
            Ok(Vec::new())
        }
    })?;
    Ok(versions.into_iter().map(|v| v.version).collect())
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

/// Runs the pending migrations of `source`; the caller holds the backend's migration lock.
pub(crate) fn run_harness<DB, C>(conn: &mut C, source: EmbeddedMigrations) -> Result<Vec<String>>
where
    DB: DieselBackend,
    C: MigrationHarness<DB> + Dialect,
{
    let applied = conn.run_pending_migrations(source).map_err(|e| {
        match e.downcast::<diesel::result::Error>() {
            Ok(db_error) => Error::Database(*db_error),
            Err(other) => Error::Migration(other.to_string()),
        }
    })?;
    Ok(applied.into_iter().map(|v| v.to_string()).collect())
}

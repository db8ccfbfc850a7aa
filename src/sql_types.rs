//! SQL types that mean the same thing on every backend, stored the way each backend needs.
//!
//! Their `FromSql`/`ToSql` implementations live in the backend files (`src/backend/*.rs`).

use diesel::expression::{AppearsOnTable, Expression, SelectableExpression, ValidGrouping};
use diesel::query_builder::QueryId;
use diesel::sql_types::SqlType;

/// An instant in UTC, with microseconds where the database keeps them.
///
/// - PostgreSQL: `timestamptz`.
/// - MySQL/MariaDB: `DATETIME(6)`, holding UTC (not `TIMESTAMP`, which follows the session
///   time zone and ends in 2038).
/// - SQLite: `TEXT` in the one layout `YYYY-MM-DD HH:MM:SS.SSS`, the layout of
///   `strftime('%Y-%m-%d %H:%M:%f','now')`, so that comparing texts compares instants. SQLite's
///   clock has millisecond resolution.
///
/// Maps to `chrono::DateTime<Utc>`.
#[derive(Debug, Clone, Copy, Default, SqlType, QueryId)]
#[cfg_attr(
    feature = "postgres",
    diesel(postgres_type(oid = 1184, array_oid = 1185))
)]
#[cfg_attr(feature = "mysql", diesel(mysql_type(name = "DateTime")))]
#[cfg_attr(feature = "sqlite", diesel(sqlite_type(name = "Text")))]
pub struct Instant;

/// A random 128-bit token (a fencing or claim token): `uuid` on PostgreSQL, `BINARY(16)` on
/// MySQL/MariaDB, a 16-byte `BLOB` on SQLite. Maps to `uuid::Uuid`.
#[derive(Debug, Clone, Copy, Default, SqlType, QueryId)]
#[cfg_attr(
    feature = "postgres",
    diesel(postgres_type(oid = 2950, array_oid = 2951))
)]
#[cfg_attr(feature = "mysql", diesel(mysql_type(name = "Blob")))]
#[cfg_attr(feature = "sqlite", diesel(sqlite_type(name = "Binary")))]
pub struct Token;

/// The database's clock as a diesel expression of type [`Instant`], spelled as dibs spells it
/// on each backend (`statement_timestamp()`, `UTC_TIMESTAMP(6)`, SQLite's `strftime`): for
/// your own queries that compare against the instants dibs stores.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use diesel::prelude::*;
/// use dibs::schema::dibs_leases;
/// use dibs::sql_types::DatabaseNow;
/// # let mut conn = dibs::AnyConnection::connect(":memory:")?;
/// # dibs::run_migrations(&mut conn)?;
/// dibs::lease::try_take(&mut conn, "backup", std::time::Duration::from_secs(60), "me")?;
/// let held: i64 = dibs_leases::table
///     .filter(dibs_leases::token.is_not_null().and(dibs_leases::expires_at.gt(DatabaseNow)))
///     .count()
///     .get_result(&mut conn)?;
/// assert_eq!(held, 1);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, QueryId, ValidGrouping)]
pub struct DatabaseNow;

impl Expression for DatabaseNow {
    type SqlType = Instant;
}

impl<QS> SelectableExpression<QS> for DatabaseNow {}
impl<QS> AppearsOnTable<QS> for DatabaseNow {}

/// The layout of [`Instant`] on SQLite.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_INSTANT_FORMAT: &str = "%Y-%m-%d %H:%M:%S%.3f";

/// Reads a 16-byte token, whatever the backend handed over.
pub(crate) fn token_from_bytes(bytes: &[u8]) -> diesel::deserialize::Result<uuid::Uuid> {
    uuid::Uuid::from_slice(bytes).map_err(|e| format!("token is not 16 bytes: {e}").into())
}

//! SQL types that mean the same thing on every backend, stored the way each backend needs.
//!
//! Their `FromSql`/`ToSql` implementations live in the backend files (`src/backend/*.rs`).

use diesel::backend::Backend;
use diesel::expression::{
    AppearsOnTable, AsExpression, Expression, SelectableExpression, ValidGrouping,
};
use diesel::query_builder::QueryId;
use diesel::serialize::{self, Output, ToSql};
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

/// The database's clock as a diesel expression of type [`Instant`], spelled as tenure spells it
/// on each backend (`statement_timestamp()`, `UTC_TIMESTAMP(6)`, SQLite's `strftime`): for
/// your own queries that compare against the instants tenure stores.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use diesel::prelude::*;
/// use tenure::schema::tenure_leases;
/// use tenure::sql_types::DatabaseNow;
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// tenure::lease::try_take(&mut conn, "backup", std::time::Duration::from_secs(60), "me")?;
/// let held: i64 = tenure_leases::table
///     .filter(tenure_leases::token.is_not_null().and(tenure_leases::expires_at.gt(DatabaseNow)))
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

/// A `chrono::DateTime<Utc>` to bind as an [`Instant`] in your own queries:
/// `tenure_jobs::due_at.lt(InstantValue(cutoff))` (also against `Nullable<Instant>` columns).
///
/// A plain `DateTime<Utc>` cannot be: diesel binds it as its own timestamp types, and Rust's
/// coherence rules keep any crate but diesel from making it an [`Instant`] expression.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use diesel::prelude::*;
/// use tenure::schema::tenure_jobs;
/// use tenure::sql_types::InstantValue;
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// let in_an_hour = chrono::Utc::now() + chrono::Duration::hours(1);
/// let due_soon: i64 = tenure_jobs::table
///     .filter(tenure_jobs::due_at.lt(InstantValue(in_an_hour)))
///     .count()
///     .get_result(&mut conn)?;
/// # assert_eq!(due_soon, 0);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, AsExpression)]
#[diesel(sql_type = Instant)]
pub struct InstantValue(pub chrono::DateTime<chrono::Utc>);

impl<DB: Backend> ToSql<Instant, DB> for InstantValue
where
    chrono::DateTime<chrono::Utc>: ToSql<Instant, DB>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
        self.0.to_sql(out)
    }
}

/// A `uuid::Uuid` to bind as a [`Token`] in your own queries:
/// `tenure_leases::token.eq(TokenValue(lease.token()))`. (A plain `Uuid` cannot be, for the
/// reason given at [`InstantValue`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, AsExpression)]
#[diesel(sql_type = Token)]
pub struct TokenValue(pub uuid::Uuid);

impl<DB: Backend> ToSql<Token, DB> for TokenValue
where
    uuid::Uuid: ToSql<Token, DB>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, DB>) -> serialize::Result {
        self.0.to_sql(out)
    }
}

/// The layout of [`Instant`] on SQLite.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_INSTANT_FORMAT: &str = "%Y-%m-%d %H:%M:%S%.3f";

/// Reads a 16-byte token, whatever the backend handed over.
pub(crate) fn token_from_bytes(bytes: &[u8]) -> diesel::deserialize::Result<uuid::Uuid> {
    uuid::Uuid::from_slice(bytes).map_err(|e| format!("token is not 16 bytes: {e}").into())
}

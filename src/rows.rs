//! The rows tenure's hand-written statements read, one type per shape (diesel's
//! `QueryableByName`: each field is read from the column of its name, so a statement names
//! its columns, or aliases them, as the row type does). Rows that only one statement reads
//! stay next to it.

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use crate::sql_types::Instant;

/// An id (`id`).
#[derive(QueryableByName)]
pub(crate) struct IdRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
}

/// A job's id and state (`id`, `state`).
#[derive(QueryableByName)]
pub(crate) struct IdStateRow {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Text)]
    pub state: String,
}

/// A count (`COUNT(*) AS n`).
#[derive(QueryableByName)]
pub(crate) struct Count {
    #[diesel(sql_type = BigInt)]
    pub n: i64,
}

/// A nullable small number (`... AS n`): a `SUM` or `MAX` over no rows, or a column that may
/// be NULL.
#[derive(QueryableByName)]
pub(crate) struct NullableInt {
    #[diesel(sql_type = Nullable<Integer>)]
    pub n: Option<i32>,
}

/// An instant (`... AS at`).
#[derive(QueryableByName)]
pub(crate) struct At {
    #[diesel(sql_type = Instant)]
    pub at: DateTime<Utc>,
}

/// An instant that may be NULL (`... AS at`).
#[derive(QueryableByName)]
pub(crate) struct NullableAt {
    #[diesel(sql_type = Nullable<Instant>)]
    pub at: Option<DateTime<Utc>>,
}

/// A queue's name (`queue`).
#[derive(QueryableByName)]
pub(crate) struct QueueRow {
    #[diesel(sql_type = Text)]
    pub queue: String,
}

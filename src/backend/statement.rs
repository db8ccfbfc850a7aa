//! tenure's tuned SQL as statements diesel keeps prepared, once per connection.
//!
//! diesel's `sql_query` marks itself unsafe to cache, so every call prepares its text again
//! (on MySQL/MariaDB an extra round trip each time). A [`Statement`] is the same idea (fixed
//! text with `?` placeholders and typed binds) that diesel may cache: its cache key is the
//! text and the bind types, so one template is prepared once per connection and then only
//! executed. Placeholders are written by diesel's query builder (`$1` on PostgreSQL, `?`
//! elsewhere), values are never part of the text.
//!
//! A list of ids (`{ids}` in the text) is bound as one `(?, ?, ...)` per call, padded to the
//! next power of four by repeating the last id (harmless in `IN`): at most 6 shapes of a
//! statement (1, 4, 16, 64, 256, 1024 ids) for 1 to [`MAX_BATCH`](crate::jobs::MAX_BATCH)
//! ids, each prepared once. Powers of four, not two: a connection that has run every
//! operation at every length holds about 120 prepared statements rather than 176, which
//! matters on MySQL/MariaDB, whose `max_prepared_stmt_count` (16,382 by default) counts every
//! connection of the server. Why not
//! one array parameter (`= ANY($1)`) or a JSON list unpacked in the statement: an `IN` list
//! of constants keeps the plan the MySQL rules need (an UPDATE or DELETE by ids has the
//! primary key alone in its WHERE; no DML reads a table through a subquery), and one shape
//! serves all three backends.
//!
//! A list of names (`{names}`, e.g. the kinds a claim takes) is bound the same way, padded by
//! repeating its last name, in the same lengths: `(?, ?, ...)` of text.

use std::borrow::Cow;
use std::marker::PhantomData;

use diesel::backend::Backend;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType, Untyped};
use diesel::{QueryResult, RunQueryDsl};

/// Where a statement's id list goes.
const IDS: &str = "{ids}";

/// The length a list of `n` values is padded to: the next power of four (1, 4, 16, ...).
fn padded_len(n: usize) -> usize {
    let mut shape = 1;
    while shape < n {
        shape *= 4;
    }
    shape
}

/// `(?, ?, ...)` with `n` placeholders.
fn placeholder_list(n: usize) -> String {
    format!("({})", vec!["?"; n].join(", "))
}

/// A statement with `?` placeholders and typed binds, cacheable by diesel.
#[must_use = "a statement does nothing until it is executed or loaded"]
pub(crate) struct Statement<B = ()> {
    sql: Cow<'static, str>,
    binds: B,
    cache: bool,
}

/// A statement of this text (already rendered for the backend: see `Syntax::render`).
pub(crate) fn statement(sql: impl Into<Cow<'static, str>>) -> Statement {
    Statement {
        sql: sql.into(),
        binds: (),
        cache: true,
    }
}

/// One bound value of SQL type `ST`.
pub(crate) struct Bind<ST, V> {
    value: V,
    sql_type: PhantomData<ST>,
}

/// The ids of an `{ids}` list, padded to the list's shape.
pub(crate) struct Ids(Vec<i64>);

/// The binds of one row of a multi-row statement, made with [`row`].
pub(crate) struct Row<B>(B);

/// Rows of binds of one shape, bound one after the other.
pub(crate) struct Rows<R>(Vec<Row<R>>);

/// The binds of a row of a multi-row insert (see [`Statement::bind_rows`]).
pub(crate) fn row() -> Row<()> {
    Row(())
}

impl<B> Row<B> {
    /// Binds the row's next placeholder.
    pub fn bind<ST, V>(self, value: V) -> Row<(B, Bind<ST, V>)> {
        Row((
            self.0,
            Bind {
                value,
                sql_type: PhantomData,
            },
        ))
    }
}

impl<B> Statement<B> {
    /// Binds the next placeholder.
    pub fn bind<ST, V>(self, value: V) -> Statement<(B, Bind<ST, V>)> {
        Statement {
            sql: self.sql,
            binds: (
                self.binds,
                Bind {
                    value,
                    sql_type: PhantomData,
                },
            ),
            cache: self.cache,
        }
    }

    /// Binds a non-empty list of ids where the text says `{ids}` (which must come after every
    /// other placeholder): `(?, ?, ...)`, one of a few fixed lengths.
    pub fn bind_ids(self, ids: impl IntoIterator<Item = i64>) -> Statement<(B, Ids)> {
        let mut ids: Vec<i64> = ids.into_iter().collect();
        if let Some(&last) = ids.last() {
            ids.resize(padded_len(ids.len()), last);
        }
        Statement {
            sql: self
                .sql
                .replacen(IDS, &placeholder_list(ids.len()), 1)
                .into(),
            binds: (self.binds, Ids(ids)),
            cache: self.cache,
        }
    }

    /// Binds rows of binds, one after the other (a multi-row insert's `(?, ...), (?, ...)`).
    pub fn bind_rows<R>(self, rows: Vec<Row<R>>) -> Statement<(B, Rows<R>)> {
        Statement {
            sql: self.sql,
            binds: (self.binds, Rows(rows)),
            cache: self.cache,
        }
    }

    /// Not kept prepared: for statements whose text changes with their input (a multi-row
    /// insert's row count), which would fill the cache.
    pub fn uncached(mut self) -> Self {
        self.cache = false;
        self
    }
}

/// The binds of a statement, walked in order: each pushes its placeholder(s) and value(s),
/// each placeholder followed by the text up to the next one.
pub(crate) trait Binds<DB: Backend> {
    fn walk<'b>(
        &'b self,
        out: &mut AstPass<'_, 'b, DB>,
        rest: &mut dyn Iterator<Item = &'b str>,
    ) -> QueryResult<()>;
}

fn push_text<'b, DB: Backend>(
    out: &mut AstPass<'_, 'b, DB>,
    rest: &mut dyn Iterator<Item = &'b str>,
) -> QueryResult<()> {
    match rest.next() {
        Some(text) => {
            out.push_sql(text);
            Ok(())
        }
        None => Err(DieselError::QueryBuilderError(
            "a statement has more binds than placeholders".into(),
        )),
    }
}

impl<DB: Backend> Binds<DB> for () {
    fn walk<'b>(
        &'b self,
        _out: &mut AstPass<'_, 'b, DB>,
        _rest: &mut dyn Iterator<Item = &'b str>,
    ) -> QueryResult<()> {
        Ok(())
    }
}

impl<DB, B, ST, V> Binds<DB> for (B, Bind<ST, V>)
where
    DB: Backend + HasSqlType<ST>,
    B: Binds<DB>,
    V: ToSql<ST, DB>,
{
    fn walk<'b>(
        &'b self,
        out: &mut AstPass<'_, 'b, DB>,
        rest: &mut dyn Iterator<Item = &'b str>,
    ) -> QueryResult<()> {
        self.0.walk(out, rest)?;
        out.push_bind_param::<ST, V>(&self.1.value)?;
        push_text(out, rest)
    }
}

impl<DB, B> Binds<DB> for (B, Ids)
where
    DB: Backend + HasSqlType<BigInt>,
    B: Binds<DB>,
    i64: ToSql<BigInt, DB>,
{
    fn walk<'b>(
        &'b self,
        out: &mut AstPass<'_, 'b, DB>,
        rest: &mut dyn Iterator<Item = &'b str>,
    ) -> QueryResult<()> {
        self.0.walk(out, rest)?;
        for id in &self.1.0 {
            out.push_bind_param::<BigInt, i64>(id)?;
            push_text(out, rest)?;
        }
        Ok(())
    }
}

impl<DB, B, R> Binds<DB> for (B, Rows<R>)
where
    DB: Backend,
    B: Binds<DB>,
    R: Binds<DB>,
{
    fn walk<'b>(
        &'b self,
        out: &mut AstPass<'_, 'b, DB>,
        rest: &mut dyn Iterator<Item = &'b str>,
    ) -> QueryResult<()> {
        self.0.walk(out, rest)?;
        for row in &self.1.0 {
            row.0.walk(out, rest)?;
        }
        Ok(())
    }
}

impl<DB: Backend, B: Binds<DB>> QueryFragment<DB> for Statement<B> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        if !self.cache {
            out.unsafe_to_cache_prepared();
        }
        let mut parts = self.sql.split('?');
        if let Some(head) = parts.next() {
            out.push_sql(head);
        }
        self.binds.walk(&mut out, &mut parts)?;
        if parts.next().is_some() {
            return Err(DieselError::QueryBuilderError(
                "a statement has placeholders without binds".into(),
            ));
        }
        Ok(())
    }
}

impl<B> QueryId for Statement<B> {
    type QueryId = ();
    // Keyed by its text and bind types in diesel's cache.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<B> Query for Statement<B> {
    type SqlType = Untyped;
}

impl<B, Conn> RunQueryDsl<Conn> for Statement<B> {}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use diesel::sql_types::Text;

    #[test]
    fn id_lists_have_a_few_shapes_and_placeholders_match_binds() {
        let sql = |n: usize| {
            let s = statement("SELECT ? WHERE id IN {ids}")
                .bind::<Text, _>("x")
                .bind_ids((0..n as i64).collect::<Vec<_>>());
            diesel::debug_query::<diesel::sqlite::Sqlite, _>(&s).to_string()
        };
        assert!(sql(1).starts_with("SELECT ? WHERE id IN (?)"));
        assert!(sql(3).starts_with("SELECT ? WHERE id IN (?, ?, ?, ?)"));
        assert!(sql(4).starts_with("SELECT ? WHERE id IN (?, ?, ?, ?)"));
        assert_eq!(sql(5).matches('?').count(), 1 + 16);
        assert_eq!(sql(1000).matches('?').count(), 1 + 1024);
        let shapes: std::collections::HashSet<usize> =
            (1..=1000).map(|n| sql(n).matches('?').count()).collect();
        assert_eq!(shapes.len(), 6);
    }
}

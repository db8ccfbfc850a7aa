//! What a diesel MySQL connection sees when Galera rolls its open transaction back between
//! two statements (a "brute-force abort": another node's commit conflicted with it). Node 1
//! opens a transaction and updates row 1; node 2 commits a conflicting update of row 1; once
//! node 1 has applied it (and so aborted the transaction), node 1's connection sends the
//! next call of a variant (a cached prepared statement, an uncached one, a load, an
//! execute, with and without binds, and a text query), then updates row 4 and commits.
//!
//! Found (issue 37): every variant's first call gets 1213 from diesel and its own write is
//! not applied, so diesel does not lose the abort's error there (COM_STMT_CLOSE of a dropped
//! uncached statement does not consume it). Every statement after it runs in autocommit
//! (`@@in_transaction` 0, row 4 commits, COMMIT succeeds): that is the server's behaviour,
//! and this test asserts only the first half. Where tenure lost the error is still open.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::mysql::{Mysql, MysqlConnection};
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Untyped};
use diesel::{Connection, QueryResult, RunQueryDsl};

use super::galera::ClusterDb;

/// A statement diesel keeps prepared (or not): like tenure's `backend::statement`.
struct Sql {
    text: &'static str,
    cache: bool,
    bind: Option<i64>,
}

impl QueryFragment<Mysql> for Sql {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        if !self.cache {
            out.unsafe_to_cache_prepared();
        }
        match (self.bind.as_ref(), self.text.split_once('?')) {
            (Some(value), Some((head, tail))) => {
                out.push_sql(head);
                out.push_bind_param::<BigInt, i64>(value)?;
                out.push_sql(tail);
            }
            _ => out.push_sql(self.text),
        }
        Ok(())
    }
}
impl QueryId for Sql {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}
impl Query for Sql {
    type SqlType = Untyped;
}
impl RunQueryDsl<MysqlConnection> for Sql {}

#[derive(diesel::QueryableByName, Debug)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn cached(text: &'static str) -> Sql {
    Sql {
        text,
        cache: true,
        bind: None,
    }
}
fn cached_bound(text: &'static str, value: i64) -> Sql {
    Sql {
        text,
        cache: true,
        bind: Some(value),
    }
}
fn uncached_bound(text: &'static str, value: i64) -> Sql {
    Sql {
        text,
        cache: false,
        bind: Some(value),
    }
}
fn uncached(text: &'static str) -> Sql {
    Sql {
        text,
        cache: false,
        bind: None,
    }
}

fn v(conn: &mut MysqlConnection, id: i64) -> i64 {
    let sql = format!("SELECT CAST(v AS SIGNED) AS n FROM t WHERE id = {id}");
    diesel::sql_query(sql).get_result::<N>(conn).unwrap().n
}

/// Waits until `conn`'s node has row 1 at `want` (it has applied node 2's commit).
fn applied(conn: &mut MysqlConnection, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while v(conn, 1) != want {
        assert!(
            Instant::now() < deadline,
            "node 1 never applied node 2's commit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The abort itself runs in the applier beside it.
    std::thread::sleep(Duration::from_millis(200));
}

/// One round: what the first call after the abort returned, what `@@in_transaction` read
/// after it, and whether row 2's update (after the first call) committed.
fn round(db: &ClusterDb, name: &str, first: &dyn Fn(&mut MysqlConnection) -> String) -> String {
    let mut a = MysqlConnection::establish(&db.urls[0]).unwrap();
    let mut b = MysqlConnection::establish(&db.urls[1]).unwrap();
    let mut watch = MysqlConnection::establish(&db.urls[0]).unwrap();
    cached("UPDATE t SET v = v + 1 WHERE id = 2")
        .execute(&mut a)
        .unwrap();
    cached_bound("UPDATE t SET v = v + 1 WHERE id = ?", 2)
        .execute(&mut a)
        .unwrap();
    a.batch_execute("UPDATE t SET v = 0").unwrap();
    applied_all(db);
    // Warm the cache: the cached statements are prepared before the transaction.
    let _ = cached("SELECT CAST(v AS SIGNED) AS n FROM t WHERE id = 3").load::<N>(&mut a);
    let _ = cached("UPDATE t SET v = v WHERE id = 3").execute(&mut a);
    let before = v(&mut watch, 1);
    a.batch_execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN")
        .unwrap();
    cached("UPDATE t SET v = v + 1 WHERE id = 1")
        .execute(&mut a)
        .unwrap();
    b.batch_execute("UPDATE t SET v = v + 100 WHERE id = 1")
        .unwrap();
    applied(&mut watch, before + 100);
    let said = first(&mut a);
    let second = cached("UPDATE t SET v = v + 1 WHERE id = 4").execute(&mut a);
    let in_trx = diesel::sql_query("SELECT CAST(@@in_transaction AS SIGNED) AS n")
        .get_result::<N>(&mut a)
        .map(|n| n.n.to_string())
        .unwrap_or_else(|e| format!("error: {e}"));
    let commit = a.batch_execute("COMMIT");
    let (row2, row4) = (v(&mut watch, 2), v(&mut watch, 4));
    format!(
        "{name}: first -> {said}; second update -> {second:?}; @@in_transaction after: {in_trx}; \
         COMMIT -> {commit:?}; row 2 (first's write) = {row2}, row 4 (second's) = {row4}"
    )
}

fn applied_all(db: &ClusterDb) {
    for url in &db.urls {
        let mut c = MysqlConnection::establish(url).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while v(&mut c, 1) != 0 || v(&mut c, 2) != 0 || v(&mut c, 4) != 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The experiment: prints, per variant, what the connection saw; fails if a first call after
/// the abort did not return 1213 or its write was applied.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_aborts_what_diesel_sees_after_a_brute_force_abort() {
    let db = ClusterDb::new();
    let mut setup = MysqlConnection::establish(&db.urls[0]).unwrap();
    setup
        .batch_execute(
            "CREATE TABLE t (id BIGINT PRIMARY KEY, v BIGINT NOT NULL); \
             INSERT INTO t VALUES (1, 0), (2, 0), (3, 0), (4, 0)",
        )
        .unwrap();
    for url in &db.urls {
        let mut c = MysqlConnection::establish(url).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while diesel::sql_query("SELECT COUNT(*) AS n FROM t")
            .get_result::<N>(&mut c)
            .map(|n| n.n)
            .unwrap_or(0)
            != 4
        {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    type Call = Box<dyn Fn(&mut MysqlConnection) -> String>;
    let variants: Vec<(&str, Call)> = vec![
        (
            "cached load",
            Box::new(|c| {
                format!(
                    "{:?}",
                    cached("SELECT CAST(v AS SIGNED) AS n FROM t WHERE id = 3").load::<N>(c)
                )
            }),
        ),
        (
            "cached execute",
            Box::new(|c| format!("{:?}", cached("UPDATE t SET v = v WHERE id = 3").execute(c))),
        ),
        (
            "uncached load",
            Box::new(|c| {
                format!(
                    "{:?}",
                    uncached("SELECT CAST(v AS SIGNED) AS n FROM t WHERE id = 3").load::<N>(c)
                )
            }),
        ),
        (
            "uncached execute",
            Box::new(|c| {
                format!(
                    "{:?}",
                    uncached("UPDATE t SET v = v WHERE id = 3").execute(c)
                )
            }),
        ),
        (
            "new cached execute",
            Box::new(|c| {
                format!(
                    "{:?}",
                    cached("UPDATE t SET v = v + 0 WHERE id = 3").execute(c)
                )
            }),
        ),
        (
            "cached execute of a write, prepared before",
            Box::new(|c| {
                format!(
                    "{:?}",
                    cached("UPDATE t SET v = v + 1 WHERE id = 2").execute(c)
                )
            }),
        ),
        (
            "cached execute of a write, prepared now",
            Box::new(|c| {
                format!(
                    "{:?}",
                    cached("UPDATE t SET v = v + 1 WHERE id = 2 AND 1 = 1").execute(c)
                )
            }),
        ),
        (
            "uncached execute of a write",
            Box::new(|c| {
                format!(
                    "{:?}",
                    uncached("UPDATE t SET v = v + 1 WHERE id = 2").execute(c)
                )
            }),
        ),
        (
            "cached bound write, prepared before",
            Box::new(|c| {
                format!(
                    "{:?}",
                    cached_bound("UPDATE t SET v = v + 1 WHERE id = ?", 2).execute(c)
                )
            }),
        ),
        (
            "uncached bound write",
            Box::new(|c| {
                format!(
                    "{:?}",
                    uncached_bound("UPDATE t SET v = v + 1 WHERE id = ?", 2).execute(c)
                )
            }),
        ),
        (
            "text write",
            Box::new(|c| {
                format!(
                    "{:?}",
                    c.batch_execute("UPDATE t SET v = v + 1 WHERE id = 2")
                )
            }),
        ),
        (
            "text query",
            Box::new(|c| format!("{:?}", c.batch_execute("UPDATE t SET v = v WHERE id = 3"))),
        ),
    ];
    let mut report = Vec::new();
    let mut broken = Vec::new();
    for (name, first) in &variants {
        let line = round(&db, name, first.as_ref());
        eprintln!("{line}");
        // Found: every call sees 1213 and its own write is not applied; the server runs what
        // follows in autocommit (row 4 commits), so tenure must stop at the first error.
        if !line.contains("first -> Err(DatabaseError(")
            || !line.contains("Deadlock found")
            || !line.contains("row 2 (first's write) = 0,")
        {
            broken.push(line.clone());
        }
        report.push(line);
    }
    assert!(
        broken.is_empty(),
        "a call after Galera's abort did not see 1213, or its write was applied:\n{}",
        broken.join("\n")
    );
}

//! Connections' session settings: `AnyConnection::connect` applies the same settings as the pool.

use diesel::prelude::*;
use diesel::sql_types::Text;
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance};

conformance!(connect_applies_the_pools_session_settings,);

#[derive(QueryableByName, Debug, PartialEq)]
struct Setting {
    #[diesel(sql_type = Text)]
    value: String,
}

fn settings(backend: Backend, conn: &mut AnyConnection) -> Vec<String> {
    let queries: &[&str] = match backend {
        Backend::Sqlite => &[
            "SELECT CAST(journal_mode AS TEXT) AS value FROM pragma_journal_mode",
            "SELECT CAST(timeout AS TEXT) AS value FROM pragma_busy_timeout",
            "SELECT CAST(synchronous AS TEXT) AS value FROM pragma_synchronous",
            "SELECT CAST(foreign_keys AS TEXT) AS value FROM pragma_foreign_keys",
        ],
        Backend::Mysql => &[
            "SELECT CAST(@@session.time_zone AS CHAR) AS value",
            "SELECT CAST(@@session.sql_mode AS CHAR) AS value",
            "SELECT CAST(TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(), NOW()) AS CHAR) AS value",
            "SELECT CAST(@@session.idle_write_transaction_timeout AS CHAR) AS value",
        ],
        Backend::Postgres => &[
            "SELECT current_setting('TimeZone') AS value",
            "SELECT current_setting('jit') AS value",
        ],
    };
    queries
        .iter()
        .map(|q| {
            diesel::sql_query(*q)
                .get_result::<Setting>(conn)
                .unwrap_or_else(|e| panic!("{q}: {e}"))
                .value
        })
        .collect()
}

/// `AnyConnection::connect` gives the same session as a pooled connection, through each URL
/// spelling of the backend (SQLite: plain path, `sqlite://`, `file:` URI), and the values
/// the docs promise (WAL, 5000 ms, FULL = 2, foreign keys on; MySQL strict and UTC, idle
/// write transactions left alone off a cluster; PostgreSQL without JIT).
fn connect_applies_the_pools_session_settings(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    let pooled = settings(backend, &mut pool.get().unwrap());
    let mut urls = vec![db.url().to_string()];
    match backend {
        Backend::Sqlite => {
            urls.push(format!("sqlite://{}", db.url()));
            urls.push(format!("file:{}?mode=rw", db.url()));
        }
        Backend::Mysql => urls.push(db.url().replacen("mysql://", "mariadb://", 1)),
        Backend::Postgres => urls.push(db.url().replacen("postgres://", "postgresql://", 1)),
    }
    for url in urls {
        let direct = settings(backend, &mut AnyConnection::connect(&url).unwrap());
        assert_eq!(direct, pooled, "connect({url:?}) differs from the pool");
        match backend {
            Backend::Sqlite => assert_eq!(direct, ["wal", "5000", "2", "1"], "{url}"),
            Backend::Mysql => {
                assert_eq!(direct[0], "+00:00", "{url}");
                assert!(
                    direct[1].contains("STRICT_ALL_TABLES"),
                    "{url}: {}",
                    direct[1]
                );
                assert_eq!(direct[2], "0", "{url}");
                // Only a Galera node ends idle write transactions (the cluster tests check
                // that side): a lone server keeps its own setting.
                assert_eq!(direct[3], "0", "{url}");
            }
            // JIT off: a prune's statement over tenure_jobs' partitions compiled for 340 ms.
            Backend::Postgres => assert_eq!(direct[1], "off", "{url}"),
        }
    }
}

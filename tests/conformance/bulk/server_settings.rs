//! What a bulk enqueue keeps whatever the server's settings: names byte for byte whatever
//! the database's default character set (a MariaDB started without `character-set-server`
//! makes latin1 databases), and no lock beyond the keys it waits for (MariaDB's default
//! `innodb_autoinc_lock_mode = 1` holds a table-wide AUTO-INC lock through an
//! `INSERT ... SELECT`, waits included). Both broke on MariaDB with a chunk inserted from
//! `JSON_TABLE` (tried and reverted, BENCHMARKS.md); PostgreSQL and SQLite are the reference.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::{TestDb, conformance, count};

conformance!(
    a_latin1_databases_bulk_keeps_names_byte_for_byte,
    a_utf8mb3_databases_bulk_keeps_four_byte_names,
    a_latin1_databases_keyed_bulk_keeps_two_keys_apart,
);

/// A migrated database whose default character set (what a MariaDB server without
/// `character-set-server` gives every new database: latin1) is `charset`. Only the database's
/// default changes: tenure's tables name their own types (VARBINARY names).
fn migrated_with_charset(backend: Backend, charset: &str) -> TestDb {
    let db = TestDb::empty(backend);
    if backend == Backend::Mysql {
        let mut conn = db.connect();
        conn.batch_execute(&format!("ALTER DATABASE CHARACTER SET {charset}"))
            .expect("the database's default character set");
    }
    let mut conn = db.connect();
    tenure::run_migrations(&mut conn).expect("tenure's migrations");
    db
}

fn names_come_back(db: &TestDb, names: &[&str]) {
    let mut conn = db.connect();
    let batch: Vec<NewJob> = names
        .iter()
        .map(|n| NewJob::new(*n, *n, vec![1u8]).limit(*n, 2).fair_key(*n))
        .collect();
    let enqueued = jobs::enqueue_many(&mut conn, &batch).expect("enqueue_many");
    for (e, name) in enqueued.iter().zip(names) {
        let got = jobs::get(&mut conn, e.id)
            .expect("read the job back")
            .expect("the job");
        assert_eq!(
            (got.queue.as_str(), got.kind.as_str()),
            (*name, *name),
            "job {}'s names",
            e.id
        );
        let limits = jobs::limits_of(&mut conn, e.id).expect("its limits");
        assert_eq!(limits[0].key(), *name, "job {}'s limit key", e.id);
    }
    // The same names one by one (what the bulk promises to agree with).
    for name in names {
        let one = jobs::enqueue(&mut conn, &NewJob::new(*name, *name, vec![1u8])).unwrap();
        let got = jobs::get(&mut conn, one.id).unwrap().unwrap();
        assert_eq!(got.queue, *name, "a single enqueue");
    }
}

/// A database whose default character set is latin1 (MariaDB's own default): the names of a
/// bulk's jobs are stored byte for byte, as a single enqueue stores them. JSON_TABLE's
/// `TEXT` columns take the database's default character set, so "é" would come back as the
/// latin1 byte 0xE9 (not UTF-8) and "😀" as "?".
fn a_latin1_databases_bulk_keeps_names_byte_for_byte(backend: Backend) {
    let db = migrated_with_charset(backend, "latin1");
    names_come_back(
        &db,
        &["plain", "caf\u{e9}", "\u{1F600}", "\u{4e2d}\u{6587}"],
    );
}

/// The same on a utf8mb3 ("utf8") database: four-byte characters are not dropped.
fn a_utf8mb3_databases_bulk_keeps_four_byte_names(backend: Backend) {
    let db = migrated_with_charset(backend, "utf8mb3");
    names_come_back(&db, &["plain", "\u{1F600}", "a\u{1F600}b", "\u{10FFFF}"]);
}

/// A keyed bulk on a latin1 database: two different keys make two jobs, each reported new,
/// and the batch succeeds (keys "\u{1F600}" and "\u{1F603}" both become "?" in latin1).
fn a_latin1_databases_keyed_bulk_keeps_two_keys_apart(backend: Backend) {
    let db = migrated_with_charset(backend, "latin1");
    let mut conn = db.connect();
    let batch = vec![
        NewJob::new("q", "k", vec![1u8]).dedup_key("\u{1F600}"),
        NewJob::new("q", "k", vec![2u8]).dedup_key("\u{1F603}"),
    ];
    let enqueued = jobs::enqueue_many(&mut conn, &batch).expect("enqueue_many");
    assert_eq!(enqueued.len(), 2);
    assert!(
        enqueued[0].id != enqueued[1].id && !enqueued[0].existing && !enqueued[1].existing,
        "{enqueued:?}"
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 2);
}

/// Waits a bulk may cause on the servers (SQLite has one writer at a time by design).
mod waits {
    use super::*;
    use crate::common::on_servers;

    on_servers!(
        an_unrelated_enqueue_is_not_held_behind_a_bulk_waiting_for_a_key,
        a_callers_transaction_survives_a_bulk_waiting_for_its_key,
    );

    /// Opens a caller's transaction on `holder` that enqueues key "k1" and then runs `then`
    /// (with the transaction still open) while a keyed bulk that includes "k1" on another
    /// connection waits for it. Returns what `then` returned, and how the bulk ended.
    fn with_a_bulk_waiting_for_a_key<T: Send + 'static>(
        db: &TestDb,
        then: impl FnOnce(&mut tenure::AnyConnection) -> T + Send + 'static,
    ) -> (T, Result<Vec<jobs::Enqueued>, tenure::Error>) {
        let mut holder = db.connect();
        let mut bulker = db.connect();
        let go = Arc::new(Barrier::new(2));
        let go2 = go.clone();
        let bulk = std::thread::spawn(move || {
            go2.wait();
            // Fresh keys first (rows this bulk writes before it meets k1), then k1.
            let batch: Vec<NewJob> = (0..50)
                .map(|i| format!("fresh{i}"))
                .chain(["k1".to_string()])
                .map(|k| NewJob::new("q", "k", vec![]).dedup_key(k))
                .collect();
            jobs::enqueue_many(&mut bulker, &batch)
        });
        let out: Result<T, tenure::Error> = tenure::transaction(&mut holder, |conn| {
            jobs::enqueue(conn, &NewJob::new("q", "k", vec![]).dedup_key("k1"))?;
            go.wait();
            // The bulk is now waiting for k1's row lock (on a machine so loaded that it has not
            // reached k1 in 700 ms, the test proves less, and still passes).
            std::thread::sleep(Duration::from_millis(700));
            Ok(then(conn))
        });
        let out = out.expect("the caller's transaction commits");
        (out, bulk.join().unwrap())
    }

    /// While a keyed bulk waits for a key that an open transaction holds (which any keyed bulk
    /// may, for as long as that transaction lasts), an enqueue of an unrelated job on a third
    /// connection goes through at once: the bulk blocks only the key it waits for. With
    /// `INSERT ... SELECT`, InnoDB (innodb_autoinc_lock_mode = 1, the default) holds the table's
    /// AUTO-INC lock for the whole statement, wait included, so every insert into tenure_jobs
    /// by anyone waits behind it.
    fn an_unrelated_enqueue_is_not_held_behind_a_bulk_waiting_for_a_key(backend: Backend) {
        let db = TestDb::migrated(backend);
        let url = db.url().to_string();
        let (other, bulk) = with_a_bulk_waiting_for_a_key(&db, move |_| {
            let other = std::thread::spawn(move || {
                let mut conn = tenure::AnyConnection::connect(&url).unwrap();
                let start = Instant::now();
                jobs::enqueue(&mut conn, &NewJob::new("other", "k", vec![])).unwrap();
                start.elapsed()
            });
            // The caller's transaction stays open for 6 s more.
            std::thread::sleep(Duration::from_secs(6));
            other
        });
        let took = other.join().unwrap();
        bulk.expect("the bulk");
        assert!(
            took < Duration::from_secs(3),
            "an unrelated enqueue took {took:?}: it waited for a transaction it shares nothing with"
        );
    }

    /// A caller's open transaction that enqueued key k1 may enqueue again while another
    /// connection's keyed bulk waits for k1: before, the bulk simply waited; with the
    /// `INSERT ... SELECT` holding the AUTO-INC table lock while it waits, the caller's next
    /// insert needs that lock, InnoDB sees the cycle, and the caller's transaction is rolled
    /// back with "Failed to read auto-increment value from storage engine" (not even a
    /// retryable error).
    fn a_callers_transaction_survives_a_bulk_waiting_for_its_key(backend: Backend) {
        let db = TestDb::migrated(backend);
        let (second, bulk) = with_a_bulk_waiting_for_a_key(&db, |conn| {
            jobs::enqueue(conn, &NewJob::new("q", "k", vec![]).dedup_key("k2"))
        });
        let second = second.map_err(|e| format!("{e} (retryable: {})", e.is_retryable()));
        assert!(second.is_ok(), "the caller's second enqueue: {second:?}");
        let bulk = bulk.expect("the bulk");
        assert!(bulk[50].existing, "the bulk's k1 folds into the caller's");
        let mut conn = db.connect();
        assert_eq!(
            count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
            52
        );
    }
}

//! Prepared statements reused: one connection across errors and rolled-back transactions, an
//! error inside a cached statement, schema changes under cached statements, and how many
//! statements a connection keeps prepared.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use tenure::jobs::{
    self, Finished, JobClaim, JobFilter, JobState, NewJob, Outcome, Retention, Retry,
};
use tenure::{AnyConnection, Backend, Error, TenureConnection, lease};

use crate::common::{TestDb, concrete, conformance, count};

conformance!(
    one_connection_survives_errors_and_rolled_back_transactions,
    an_error_raised_inside_a_cached_statement_leaves_it_usable,
    cached_statements_survive_an_added_column_and_migrations,
    prepared_statements_per_connection_are_bounded,
    a_changed_column_type_costs_one_retryable_error,
);

const TTL: Duration = Duration::from_secs(600);

fn claims(jobs: &[jobs::ClaimedJob]) -> Vec<JobClaim> {
    jobs.iter().map(|j| j.claim()).collect()
}

fn fill(conn: &mut AnyConnection, queue: &str, n: usize) -> Vec<i64> {
    let batch: Vec<NewJob> = (0..n)
        .map(|i| NewJob::new(queue, "k", i.to_string().into_bytes()))
        .collect();
    jobs::enqueue_many(conn, &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect()
}

fn states(conn: &mut AnyConnection, queue: &str, state: &str) -> i64 {
    count(
        conn,
        &format!(
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{queue}' AND state = '{state}'"
        ),
    )
}

/// An error that rolls a transaction back.
fn rollback(_why: String) -> Error {
    Error::Database(diesel::result::Error::RollbackTransaction)
}

/// One connection, statements cached, goes through a unique violation in a caller's
/// transaction, a rolled-back transaction that finished jobs, a nested savepoint: each later
/// call on it means what it should.
fn one_connection_survives_errors_and_rolled_back_transactions(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute("CREATE TABLE mine (id BIGINT PRIMARY KEY)")
        .unwrap();
    fill(&mut conn, "tx", 8);
    let claimed = jobs::claim(&mut conn, "tx", 8, TTL).unwrap();
    let all = claims(&claimed);
    // Warm the cache with every shape used below.
    assert_eq!(
        jobs::renew(&mut conn, &all[..1], TTL).unwrap(),
        [Outcome::Done]
    );
    assert_eq!(
        jobs::renew(&mut conn, &all[..3], TTL).unwrap(),
        [Outcome::Done; 3]
    );

    // Complete in a caller's transaction, then a unique violation rolls it all back.
    let r: Result<(), Error> = tenure::transaction(&mut conn, |conn| {
        conn.batch_execute("INSERT INTO mine (id) VALUES (1)")?;
        assert_eq!(jobs::complete(conn, &all[..3]).unwrap(), [Outcome::Done; 3]);
        conn.batch_execute("INSERT INTO mine (id) VALUES (1)")?;
        Ok(())
    });
    assert!(r.is_err());
    assert_eq!(states(&mut conn, "tx", "running"), 8, "rolled back");
    // The same statements on the same connection, right after.
    assert_eq!(
        jobs::complete(&mut conn, &all[..3]).unwrap(),
        [Outcome::Done; 3]
    );
    assert_eq!(
        jobs::complete(&mut conn, &all[..3]).unwrap(),
        [Outcome::AlreadyDone; 3]
    );

    // A failed statement inside the caller's transaction, then tenure in it: an error (on
    // PostgreSQL the transaction is aborted) or a right answer, never a wrong one; afterwards
    // the connection works.
    let r: Result<Vec<Outcome>, Error> = tenure::transaction(&mut conn, |conn| {
        let _ = conn.batch_execute("INSERT INTO mine (id) VALUES (1), (1)");
        let out = jobs::complete(conn, &all[3..4])?;
        Err(rollback(format!("{out:?}")))
    });
    assert!(r.is_err());
    assert_eq!(states(&mut conn, "tx", "running"), 5);

    // Nested: the inner savepoint completes, the outer rolls back; then renew (shape 4) of
    // the still-running ones.
    let r: Result<(), Error> = tenure::transaction(&mut conn, |conn| {
        let inner: Result<Vec<Outcome>, Error> =
            tenure::transaction(conn, |conn| jobs::complete(conn, &all[3..5]));
        assert_eq!(inner.unwrap(), [Outcome::Done; 2]);
        let failed: Result<(), Error> = tenure::transaction(conn, |conn| {
            assert_eq!(jobs::give_back(conn, &all[5..6]).unwrap(), [Outcome::Done]);
            Err(rollback(String::new()))
        });
        assert!(failed.is_err());
        assert_eq!(
            jobs::get(conn, all[5].id).unwrap().unwrap().state,
            JobState::Running
        );
        Err(rollback(String::new()))
    });
    assert!(r.is_err());
    assert_eq!(states(&mut conn, "tx", "running"), 5);
    assert_eq!(
        jobs::renew(&mut conn, &all[3..8], TTL).unwrap(),
        [Outcome::Done; 5]
    );
    assert_eq!(
        jobs::give_back(&mut conn, &all[3..8]).unwrap(),
        [Outcome::Done; 5]
    );
    let again = jobs::claim(&mut conn, "tx", 8, TTL).unwrap();
    assert_eq!(again.len(), 5);
    assert_eq!(
        jobs::complete(&mut conn, &claims(&again)).unwrap(),
        [Outcome::Done; 5]
    );
    assert_eq!(states(&mut conn, "tx", "completed"), 8);
}

/// A trigger makes cached UPDATE statements fail (as a deadlock or a lock timeout would):
/// the failed call changes nothing, and once the cause is gone the same statements on the
/// same connection work.
fn an_error_raised_inside_a_cached_statement_leaves_it_usable(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut admin = db.connect();
    admin
        .batch_execute("CREATE TABLE boom (x INTEGER)")
        .unwrap();
    let trigger: &[&str] = match backend {
        Backend::Sqlite => &["CREATE TRIGGER boom_t BEFORE UPDATE ON tenure_jobs \
             WHEN EXISTS (SELECT 1 FROM boom) BEGIN SELECT RAISE(ABORT, 'boom'); END"],
        Backend::Postgres => &[
            "CREATE FUNCTION boom_f() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             IF EXISTS (SELECT 1 FROM boom) THEN RAISE EXCEPTION 'boom'; END IF; \
             RETURN NEW; END $$",
            "CREATE TRIGGER boom_t BEFORE UPDATE ON tenure_jobs FOR EACH ROW \
             EXECUTE FUNCTION boom_f()",
        ],
        Backend::Mysql => &[
            "CREATE TRIGGER boom_t BEFORE UPDATE ON tenure_jobs FOR EACH ROW \
             BEGIN IF EXISTS (SELECT 1 FROM boom) THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'boom'; END IF; END",
        ],
    };
    fill(&mut conn, "boom", 10);
    // Cache claim (shapes 1 and 4), renew, complete.
    let one = jobs::claim(&mut conn, "boom", 1, TTL).unwrap();
    assert_eq!(
        jobs::renew(&mut conn, &claims(&one), TTL).unwrap(),
        [Outcome::Done]
    );
    assert_eq!(
        jobs::complete(&mut conn, &claims(&one)).unwrap(),
        [Outcome::Done]
    );
    for sql in trigger {
        admin.batch_execute(sql).unwrap();
    }
    admin
        .batch_execute("INSERT INTO boom (x) VALUES (1)")
        .unwrap();
    let three = jobs::claim(&mut conn, "boom", 3, TTL);
    assert!(three.is_err(), "the trigger refuses the claim: {three:?}");
    admin.batch_execute("DELETE FROM boom").unwrap();
    let three = jobs::claim(&mut conn, "boom", 3, TTL).unwrap();
    assert_eq!(three.len(), 3);
    admin
        .batch_execute("INSERT INTO boom (x) VALUES (1)")
        .unwrap();
    for _ in 0..3 {
        assert!(jobs::renew(&mut conn, &claims(&three), TTL).is_err());
        assert!(jobs::complete(&mut conn, &claims(&three)).is_err());
    }
    assert_eq!(states(&mut conn, "boom", "running"), 3);
    admin.batch_execute("DELETE FROM boom").unwrap();
    assert_eq!(
        jobs::renew(&mut conn, &claims(&three), TTL).unwrap(),
        [Outcome::Done; 3]
    );
    assert_eq!(
        jobs::complete(&mut conn, &claims(&three)).unwrap(),
        [Outcome::Done; 3]
    );
    assert_eq!(states(&mut conn, "boom", "completed"), 4);
}

/// Runs every cached operation once on `conn`.
fn exercise(conn: &mut AnyConnection, round: usize) {
    let queue = format!("schema{round}");
    let id = jobs::enqueue(conn, &NewJob::new(&queue, "k", vec![1]).dedup_key("d"))
        .unwrap()
        .id;
    fill(conn, &queue, 3);
    let claimed = jobs::claim(conn, &queue, 10, TTL).unwrap();
    assert_eq!(claimed.len(), 4);
    let c = claims(&claimed);
    assert_eq!(jobs::renew(conn, &c, TTL).unwrap(), [Outcome::Done; 4]);
    assert_eq!(
        jobs::fail(conn, c[0], "x", Retry::Never).unwrap(),
        Outcome::Done
    );
    assert_eq!(jobs::give_back(conn, &c[1..2]).unwrap(), [Outcome::Done]);
    assert_eq!(jobs::complete(conn, &c[2..]).unwrap(), [Outcome::Done; 2]);
    assert_eq!(jobs::get(conn, id).unwrap().unwrap().id, id);
    assert_eq!(
        jobs::list(
            conn,
            &JobFilter {
                queue: Some(queue.clone()),
                ..JobFilter::default()
            }
        )
        .unwrap()
        .len(),
        4
    );
    assert_eq!(jobs::history(conn, id).unwrap().len(), 1);
    jobs::rescue(conn, 10).unwrap();
    assert_eq!(
        jobs::prune(conn, &queue, Finished::Completed, Retention::DeleteAll, 10).unwrap(),
        2
    );
    jobs::stats(conn).unwrap();
    let mut held = lease::try_take(conn, &queue, TTL, "h").unwrap().unwrap();
    held.renew(conn, TTL).unwrap();
    lease::inspect(conn, &queue).unwrap().unwrap();
    lease::list(conn).unwrap();
    assert!(held.release(conn).unwrap());
}

/// A user's own migration adds a column to tenure's tables between two calls on a connection
/// that has tenure's statements prepared; and `run_migrations` runs on such a connection.
fn cached_statements_survive_an_added_column_and_migrations(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    exercise(&mut conn, 0);
    let mut admin = db.connect();
    for table in ["tenure_jobs", "tenure_leases", "tenure_job_errors"] {
        admin
            .batch_execute(&format!("ALTER TABLE {table} ADD COLUMN extra INTEGER"))
            .unwrap();
    }
    exercise(&mut conn, 1);
    tenure::run_migrations(&mut conn).unwrap();
    exercise(&mut conn, 2);
    for table in ["tenure_jobs", "tenure_leases", "tenure_job_errors"] {
        admin
            .batch_execute(&format!("ALTER TABLE {table} DROP COLUMN extra"))
            .unwrap();
    }
    exercise(&mut conn, 3);
}

#[derive(QueryableByName, Debug)]
struct Held {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Statements the server holds prepared for this session (PostgreSQL: pg_prepared_statements;
/// MariaDB: prepares minus closes of this session).
fn held(conn: &mut AnyConnection) -> Option<i64> {
    let sql = match conn.backend() {
        Backend::Sqlite => return None,
        Backend::Postgres => "SELECT CAST(COUNT(*) AS BIGINT) AS n FROM pg_prepared_statements",
        Backend::Mysql => {
            "SELECT CAST(SUM(CASE VARIABLE_NAME WHEN 'COM_STMT_PREPARE' THEN 1 ELSE -1 END \
             * CAST(VARIABLE_VALUE AS SIGNED)) AS SIGNED) AS n \
             FROM information_schema.SESSION_STATUS \
             WHERE VARIABLE_NAME IN ('COM_STMT_PREPARE', 'COM_STMT_CLOSE')"
        }
    };
    Some(concrete!(conn, c => diesel::sql_query(sql).get_result::<Held>(c).unwrap().n))
}

/// Every operation through every id-list shape on one connection: how many statements the
/// server then holds for it. MariaDB's `max_prepared_stmt_count` (16,382 by default) is for
/// the whole server; a pool of N connections across P processes holds N * P times this.
fn prepared_statements_per_connection_are_bounded(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let before = held(&mut conn);
    let shapes = [1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513];
    for round in 0..2 {
        let queue = format!("shapes{round}");
        for &n in &shapes {
            fill(&mut conn, &queue, n);
            let claimed = jobs::claim(&mut conn, &queue, n, TTL).unwrap();
            assert_eq!(claimed.len(), n);
            let c = claims(&claimed);
            jobs::renew(&mut conn, &c, TTL).unwrap();
            jobs::give_back(&mut conn, &c).unwrap();
            let claimed = jobs::claim(&mut conn, &queue, n, TTL).unwrap();
            let c = claims(&claimed);
            // Half cancelled: the cancelled-finish statement in the same shape. One commit
            // for them all (a commit each, a thousand over the test, took most of nextest's
            // minute on MariaDB under load).
            tenure::transaction(&mut conn, |conn| -> Result<(), tenure::Error> {
                for j in claimed.iter().step_by(2) {
                    assert!(jobs::cancel(conn, j.id)?);
                }
                Ok(())
            })
            .unwrap();
            jobs::complete(&mut conn, &c).unwrap();
            assert_eq!(
                jobs::prune(
                    &mut conn,
                    &queue,
                    Finished::Completed,
                    Retention::DeleteAll,
                    1000
                )
                .unwrap(),
                n / 2
            );
            jobs::prune(
                &mut conn,
                &queue,
                Finished::Cancelled,
                Retention::DeleteAll,
                1000,
            )
            .unwrap();
            fill(&mut conn, &queue, n);
            jobs::claim(&mut conn, &queue, n, Duration::from_millis(1)).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(jobs::rescue(&mut conn, n).unwrap().requeued.len(), n);
            let claimed = jobs::claim(&mut conn, &queue, n, TTL).unwrap();
            jobs::complete(&mut conn, &claims(&claimed)).unwrap();
            jobs::list(
                &mut conn,
                &JobFilter {
                    ids: Some(claimed.iter().map(|j| j.id).collect()),
                    ..JobFilter::default()
                },
            )
            .unwrap();
            jobs::prune(
                &mut conn,
                &queue,
                Finished::Completed,
                Retention::DeleteAll,
                1000,
            )
            .unwrap();
        }
        exercise(&mut conn, 10 + round);
    }
    let after = held(&mut conn);
    eprintln!("{backend}: statements held prepared by one connection: {before:?} -> {after:?}");
    if let (Some(before), Some(after)) = (before, after) {
        let per_connection = after - before;
        // 16,382 / this = connections (summed over every process) the server can serve.
        eprintln!(
            "{backend}: {per_connection} per connection; MariaDB's default limit serves {} \
             such connections",
            16_382 / per_connection.max(1)
        );
        // 152 on MariaDB once prune also deleted parks and steps (two more per-job tables,
        // a statement per id-list bucket each: the bucketing, not the count, is what this
        // bounds; 180 still serves 91 connections per server at MariaDB's default).
        assert!(
            per_connection <= 180,
            "{backend}: one connection holds {per_connection} prepared statements"
        );
    }
}

/// A migration changes the type of a column tenure reads (here `last_error`; a future tenure
/// migration, or a user's, may retype any column). PostgreSQL then refuses every statement
/// prepared before that returns the column ("cached plan must not change result type"), and
/// diesel would keep the refused statement: every later call failed, for the connection's
/// life, also in a pool (found by this attack; it failed 3 of 3 rounds before the fix). Now
/// the first call fails with a retryable error and the connection forgets its prepared
/// statements; every later call works. MariaDB and SQLite prepare again by themselves.
fn a_changed_column_type_costs_one_retryable_error(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    exercise(&mut conn, 0);
    let (alter, back) = match backend {
        // SQLite has no column types to change; it prepares again on any schema change.
        Backend::Sqlite => return,
        Backend::Postgres => (
            "ALTER TABLE tenure_jobs ALTER COLUMN last_error TYPE varchar(20000)",
            "ALTER TABLE tenure_jobs ALTER COLUMN last_error TYPE text",
        ),
        Backend::Mysql => (
            "ALTER TABLE tenure_jobs MODIFY last_error MEDIUMTEXT",
            "ALTER TABLE tenure_jobs MODIFY last_error TEXT",
        ),
    };
    let id = jobs::enqueue(&mut conn, &NewJob::new("typed", "k", vec![]))
        .unwrap()
        .id;
    jobs::get(&mut conn, id).unwrap();
    db.connect().batch_execute(alter).unwrap();
    if let Err(e) = jobs::get(&mut conn, id) {
        assert!(e.is_retryable(), "{backend}: not retryable: {e}");
    }
    for round in 1..=3 {
        exercise(&mut conn, round);
    }
    // The same through a pool of one, changing the type back.
    let pool = db.pool(1);
    jobs::get(&mut pool.get().unwrap(), id).unwrap();
    db.connect().batch_execute(back).unwrap();
    if let Err(e) = jobs::get(&mut pool.get().unwrap(), id) {
        assert!(e.is_retryable(), "{backend}: not retryable: {e}");
    }
    let failed: Vec<String> = (0..3)
        .filter_map(|_| jobs::get(&mut pool.get().unwrap(), id).err())
        .map(|e| e.to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{backend}: pooled gets failed: {failed:?}"
    );
}

//! A claim never waits for a job another transaction holds (a cancel, a fold, the ager, a
//! caller's own lock): it passes over it, takes the others, and the job is claimed once the
//! holder lets go. On PostgreSQL the pick locks the ring's entries only and the mark locks
//! the jobs (`Syntax::claim_mark_ids`): a mark that waited would wait for the holder, and a
//! holder that itself waits for the claim's entry (a cancel, through the ring's trigger)
//! would deadlock with it. The servers only: on SQLite a claim's IMMEDIATE transaction waits
//! for any other writer by design. `next_jobs`: what such a claim takes instead; `races`:
//! claims racing every writer of a waiting job, on every backend.

use std::sync::mpsc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::sql_types::Text;
use diesel::{QueryableByName, RunQueryDsl};
use tenure::jobs::{self, ClaimedJob, JobState, NewJob};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count, enqueue_id, job_state, on_servers, wait_until};

mod limit_races;
mod limits;
mod next_jobs;
mod races;

on_servers!(
    a_claim_passes_over_a_job_another_transaction_holds,
    a_cancel_waiting_for_a_claims_entry_is_neither_deadlocked_nor_overtaken,
);

const TTL: Duration = Duration::from_secs(60);
/// How long a claim may take on a loaded machine before the test calls it blocked: a bound,
/// never a measurement (a claim that waits for the holder waits until it lets go).
const BLOCKED: Duration = Duration::from_secs(30);

/// The claimed jobs' ids, sorted.
/// Whether no job of `queue` (the test's own constant name) waits or runs: a claimer that
/// came back empty stops once this holds and the disruptions are over.
fn nothing_live(conn: &mut AnyConnection, queue: &str) -> bool {
    let sql = format!(
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{queue}' \
         AND state IN ('waiting', 'running')"
    );
    count(conn, &sql) == 0
}

fn ids(jobs: &[ClaimedJob]) -> Vec<i64> {
    let mut ids: Vec<i64> = jobs.iter().map(|j| j.id).collect();
    ids.sort_unstable();
    ids
}

/// A transaction, on a connection of its own, that holds job `id`'s row lock until it ends.
fn hold(db: &TestDb, id: i64) -> AnyConnection {
    let mut holder = db.connect_raw();
    holder.batch_execute("BEGIN").unwrap();
    holder
        .batch_execute(&format!(
            "SELECT id FROM tenure_jobs WHERE id = {id} FOR UPDATE"
        ))
        .unwrap();
    holder
}

/// Runs `claim` on its own thread while `holder` keeps its transaction open; the claim must
/// return within [`BLOCKED`]. Returns what it claimed; the holder rolls back after.
fn claim_beside(
    mut holder: AnyConnection,
    mut conn: AnyConnection,
    claim: impl FnOnce(&mut AnyConnection) -> Vec<ClaimedJob> + Send + 'static,
) -> (AnyConnection, Vec<ClaimedJob>) {
    let (sent, got) = mpsc::channel();
    let claimer = std::thread::spawn(move || {
        let claimed = claim(&mut conn);
        sent.send(()).unwrap();
        (conn, claimed)
    });
    let returned = got.recv_timeout(BLOCKED).is_ok();
    holder.batch_execute("ROLLBACK").unwrap();
    let out = claimer.join().unwrap();
    assert!(
        returned,
        "the claim waited for the job another transaction held"
    );
    out
}

/// This connection's server session (PostgreSQL's backend pid, MariaDB's connection id).
fn session_of(conn: &mut AnyConnection, backend: Backend) -> i64 {
    let sql = match backend {
        Backend::Postgres => "SELECT CAST(pg_backend_pid() AS BIGINT) AS n",
        _ => "SELECT CAST(CONNECTION_ID() AS SIGNED) AS n",
    };
    count(conn, sql)
}

/// Whether the server session `session` waits for a row lock now. MariaDB: the session's
/// transaction in InnoDB's status (its `INNODB_TRX` did not list a transaction waiting in an
/// upsert: seen on 10.11).
fn waits_for_a_lock(conn: &mut AnyConnection, backend: Backend, session: i64) -> bool {
    match backend {
        Backend::Postgres => {
            count(
                conn,
                &format!(
                    "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE pid = {session} \
                     AND wait_event_type = 'Lock'"
                ),
            ) > 0
        }
        _ => {
            #[derive(QueryableByName)]
            struct Status {
                #[diesel(sql_type = Text, column_name = "Status")]
                status: String,
            }
            let status = diesel::sql_query("SHOW ENGINE INNODB STATUS")
                .get_result::<Status>(conn)
                .unwrap()
                .status;
            let thread = format!("MariaDB thread id {session},");
            status
                .split("---TRANSACTION")
                .any(|trx| trx.contains(&thread) && trx.contains("LOCK WAIT"))
        }
    }
}

/// Makes each PostgreSQL session flush its statistics (`pg_stat_force_next_flush` takes
/// effect when the session next goes idle: the second statement runs after it did).
fn flush_stats(sessions: &mut [AnyConnection]) {
    for conn in sessions.iter_mut() {
        conn.batch_execute("SELECT pg_stat_force_next_flush()")
            .unwrap();
        conn.batch_execute("SELECT 1").unwrap();
    }
}

/// Ends a race's round: each of its `sessions` flushes its deadlock count (PostgreSQL) and
/// closes (a round's sessions kept open would reach the server's connection limit); then
/// every job of `queue` has finished.
fn end_round(
    backend: Backend,
    setup: &mut AnyConnection,
    mut sessions: Vec<AnyConnection>,
    queue: &str,
    round: usize,
) {
    if backend == Backend::Postgres {
        flush_stats(&mut sessions);
    }
    drop(sessions);
    assert_eq!(
        count(
            setup,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{queue}' \
                 AND state NOT IN ('completed', 'cancelled')"
            )
        ),
        0,
        "round {round}: every job finished"
    );
}

/// PostgreSQL's count of deadlocks detected in this test's database, each of `sessions`'
/// statistics flushed first.
fn deadlocks(db: &TestDb, sessions: &mut [AnyConnection]) -> i64 {
    flush_stats(sessions);
    count(
        &mut db.connect(),
        "SELECT deadlocks AS n FROM pg_stat_database WHERE datname = current_database()",
    )
}

/// Three waiting jobs; another transaction locks the first in claim order. A claim of ten
/// returns the other two while the lock is held (it neither waits nor fails), and the held
/// job is claimed once the holder rolls back.
fn a_claim_passes_over_a_job_another_transaction_holds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let waiting: Vec<i64> = (0..3u8)
        .map(|i| enqueue_id(&mut conn, NewJob::new("held", "work", vec![i])))
        .collect();
    let holder = hold(&db, waiting[0]);
    let (mut conn, got) = claim_beside(holder, conn, |c| {
        jobs::claim(c, "held", 10, TTL).expect("the claim succeeds")
    });
    assert_eq!(
        ids(&got),
        waiting[1..].to_vec(),
        "the claim takes the jobs nobody holds"
    );
    assert_eq!(job_state(&mut conn, waiting[0]), JobState::Waiting);
    let after = jobs::claim(&mut conn, "held", 10, TTL).unwrap();
    assert_eq!(
        ids(&after),
        vec![waiting[0]],
        "the held job is claimed once let go"
    );
}

/// The interleaving that deadlocks a mark that waits: a claim has picked (and holds) a
/// limited job's entry and waits for the job's limit key, which a third transaction holds;
/// a cancel of that job then locks the job and waits, through the ring's trigger, for the
/// entry. When the key is let go the claim must not wait for the cancel's job lock: the
/// cancel succeeds, the claim returns without the job, and (PostgreSQL) the server detected
/// no deadlock (a deadlock's victim would have been retried inside tenure, unseen but for
/// the server's count). Where the pick locks the job too (MariaDB) the cancel waits for the
/// job instead and finds it running: exactly one of the two takes it either way.
fn a_cancel_waiting_for_a_claims_entry_is_neither_deadlocked_nor_overtaken(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = enqueue_id(
        &mut conn,
        NewJob::new("held", "work", vec![1]).limit("k", 5),
    );
    let mut key_holder = db.connect_raw();
    key_holder.batch_execute("BEGIN").unwrap();
    // The key's lock as a claim's admission takes it (`flow::admission`).
    key_holder
        .batch_execute(match backend {
            Backend::Postgres => {
                "INSERT INTO tenure_limit_keys (limit_key) VALUES ('k') \
                 ON CONFLICT (limit_key) DO UPDATE SET limit_key = excluded.limit_key"
            }
            _ => {
                "INSERT INTO tenure_limit_keys (limit_key) VALUES ('k') \
                 ON DUPLICATE KEY UPDATE admissions = admissions + 1"
            }
        })
        .unwrap();
    let mut watcher = db.connect();
    let claim_session = session_of(&mut conn, backend);
    let claimer = std::thread::spawn(move || {
        let got = jobs::claim(&mut conn, "held", 10, TTL);
        (conn, got)
    });
    wait_until("the claim to wait for the limit key", BLOCKED, || {
        waits_for_a_lock(&mut watcher, backend, claim_session).then_some(())
    });
    let mut canceller_conn = db.connect();
    let cancel_session = session_of(&mut canceller_conn, backend);
    let canceller = std::thread::spawn(move || {
        let cancelled = jobs::cancel(&mut canceller_conn, id);
        (canceller_conn, cancelled)
    });
    wait_until("the cancel to wait for the claim", BLOCKED, || {
        waits_for_a_lock(&mut watcher, backend, cancel_session).then_some(())
    });
    key_holder.batch_execute("COMMIT").unwrap();
    let (conn, claimed) = claimer.join().unwrap();
    let (canceller_conn, cancelled) = canceller.join().unwrap();
    let claimed: Vec<i64> = claimed
        .expect("the claim succeeds")
        .iter()
        .map(|j| j.id)
        .collect();
    let cancelled = cancelled.expect("the cancel succeeds");
    let state = job_state(&mut watcher, id);
    match backend {
        Backend::Postgres => {
            assert_eq!(claimed, Vec::<i64>::new(), "the claim passed over the job");
            assert!(cancelled, "the cancel took the waiting job");
            assert_eq!(state, JobState::Cancelled);
            assert_eq!(
                deadlocks(&db, &mut [conn, canceller_conn]),
                0,
                "the claim and the cancel deadlocked"
            );
        }
        _ => {
            // The pick held the job: the claim took it, the cancel asked the run to stop.
            assert_eq!(claimed, vec![id], "the claim that held the job took it");
            assert_eq!(state, JobState::Running);
        }
    }
}

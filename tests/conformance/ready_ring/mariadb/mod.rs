//! MariaDB's ring (`migrations/mysql/tenure-0045_ready_ring`): its triggers read the
//! generation without a lock, so a transaction with an old read view puts its entry in an
//! older slot; a rotation is one batch under a table lock, each statement committed on its
//! own. Nothing may lose an entry or leave one behind: here, what changes jobs and the ring
//! around rotations (old read views, the migration, time zones, a missing row, an id
//! changed); a rotation stopped at any point ([`kills`]); callers at REPEATABLE READ racing
//! rotations ([`read_views`]); a stalled client ([`stalls`]); when a rotation is worth its
//! cost ([`purge`]); bulk enqueues that write their own entries, raced ([`bulk_races`]).

mod bulk_races;
mod kills;
mod purge;
mod read_views;
mod stalls;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, NewJob};
use tenure::{AnyConnection, Backend, Error};

use super::{NO_WAIT, TTL, assert_ring_exact, drain, rotate_times};
use crate::common::{TestDb, count};

/// The slot new entries go to, and the one the next rotation empties.
pub(super) fn slots(conn: &mut AnyConnection) -> (i64, i64) {
    let generation = count(conn, "SELECT generation AS n FROM tenure_ready_ring");
    (generation % 3, (generation + 1) % 3)
}

/// A claim of queue `q` on a connection of its own, in a thread: the receiver gets how
/// long it took (to tell a claim held behind the ring's lock from one that went through).
pub(super) fn timed_claim(
    db: &TestDb,
) -> (
    std::sync::mpsc::Receiver<std::time::Duration>,
    std::thread::JoinHandle<Result<usize, Error>>,
) {
    let (sender, receiver) = std::sync::mpsc::channel();
    let mut conn = db.connect();
    let claimer = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let taken = jobs::claim(&mut conn, "q", 10, TTL).map(|b| b.len());
        sender.send(started.elapsed()).unwrap();
        taken
    });
    (receiver, claimer)
}

/// A caller's REPEATABLE READ transaction reads (its read view starts), two rotations run
/// on another connection, then it enqueues: its trigger reads the generation of its read
/// view, two behind, so the entry goes to the slot the next rotation empties. That rotation
/// moves it (it commits before, and the rotation's lock waits for no one: the caller has
/// ended), and the job is claimed once. (A rotation that truncated the slot without moving
/// what it holds would lose the job for good.)
#[test]
fn mysql_an_entry_written_under_an_old_read_view_survives_the_rotations() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    caller
        .batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    let id = caller
        .transaction::<_, Error, _>(|c| {
            // The read view starts at the first read (of another table: one of the ring's
            // would hold its metadata lock, and no rotation could run).
            count(c, "SELECT COUNT(*) AS n FROM tenure_leases");
            let rotated = rotate_times(&mut conn, 2);
            assert_eq!(rotated, 2, "rotations beside the caller's read view");
            Ok(jobs::enqueue(c, &NewJob::new("q", "a", vec![]))?.id)
        })
        .unwrap();
    let (_, oldest) = slots(&mut conn);
    let slot = count(
        &mut conn,
        &format!("SELECT slot AS n FROM tenure_ready WHERE id = {id}"),
    );
    assert_eq!(
        slot, oldest,
        "the entry went to the slot of the caller's read view, the next one emptied"
    );
    for round in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
        assert_ring_exact(&mut conn, backend, &format!("after rotation {round}"));
    }
    assert_eq!(drain(&mut conn), vec![id], "the job, once");
}

/// The ring's migration (`tenure-0045_ready_ring/up.sql`) on a live database while a
/// rotation runs between two of its statements, as another process's worker may: the
/// migration is one batch whose statements each commit on their own, and `rotate_ready` takes
/// no migration lock (its `LOCK TABLES ... NOWAIT` is granted between two statements). The
/// rotation moves the generation on, an enqueue's trigger then puts its entry in slot 1,
/// and the migration's last statement (`INSERT IGNORE ... SELECT 0, id ...`) adds a second
/// entry for the same job in slot 0: IGNORE only skips an entry of the same slot. The ring
/// must hold one entry per waiting job.
#[test]
fn mysql_a_rotation_during_the_rings_migration_leaves_one_entry_per_job() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut migrator = db.connect();
    let mut worker = db.connect();
    // Undone: the fair claiming's migration (which changed the ring), then the ring's.
    migrator
        .batch_execute(include_str!(
            "../../../../migrations/mysql/tenure-0054_fair_claiming/down.sql"
        ))
        .unwrap();
    migrator
        .batch_execute(include_str!(
            "../../../../migrations/mysql/tenure-0045_ready_ring/down.sql"
        ))
        .unwrap();
    let before = insert_job_as_before(&mut worker);
    // The migration's statements in its order, split before its last one.
    let up = include_str!("../../../../migrations/mysql/tenure-0045_ready_ring/up.sql");
    let (head, last) = up
        .rsplit_once("INSERT INTO tenure_ready ")
        .expect("the migration ends with the waiting jobs' entries");
    migrator.batch_execute(head).unwrap();
    // Between two statements: a worker's rotation, then an enqueue.
    assert!(
        jobs::rotate_ready(&mut worker, NO_WAIT).unwrap().is_some(),
        "a rotation between two of the migration's statements"
    );
    let during = insert_job_as_before(&mut worker);
    migrator
        .batch_execute(&format!("INSERT INTO tenure_ready {last}"))
        .unwrap();
    migrator
        .batch_execute(include_str!(
            "../../../../migrations/mysql/tenure-0054_fair_claiming/up.sql"
        ))
        .unwrap();
    let entries = count(
        &mut worker,
        &format!("SELECT COUNT(*) AS n FROM tenure_ready WHERE id = {during}"),
    );
    println!("job {before} waited before the migration; job {during} has {entries} entries");
    let taken: Vec<i64> = jobs::claim(&mut worker, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    println!("a claim took {taken:?}");
    assert_eq!(
        entries, 1,
        "the job enqueued during the migration has {entries} entries in the ring"
    );
    assert_ring_exact(&mut worker, backend, "after the migration");
}

/// A rotation from a session whose time zone is east of UTC (a user's own connection, as
/// `connect_raw` gives, in the server's default zone or one set for its own queries: every
/// other statement of tenure reads `UTC_TIMESTAMP(6)`, "whatever the session's time zone")
/// writes `rotated_at` by `NOW(6)`, ten hours ahead of tenure's UTC sessions. Then a forced
/// rotation (`min_interval` zero) from tenure's own session must still run; it says "not
/// due" (`None`) for ten hours, and the ring stops rotating.
#[test]
fn mysql_a_rotation_from_a_session_east_of_utc_does_not_stop_the_ring() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut east = db.connect_raw();
    east.batch_execute("SET time_zone = '+10:00'").unwrap();
    assert!(
        jobs::rotate_ready(&mut east, NO_WAIT).unwrap().is_some(),
        "the first rotation, from the session at +10:00"
    );
    let mut conn = db.connect();
    let later: Vec<Option<u64>> = (0..3)
        .map(|_| jobs::rotate_ready(&mut conn, NO_WAIT).unwrap())
        .collect();
    assert!(
        later.iter().all(Option::is_some),
        "forced rotations from tenure's UTC session after one from +10:00: {later:?}"
    );
}

/// `tenure_ready_ring`'s one row gone (deleted by hand, a restore that left it out): a
/// forced rotation cannot run, and must say so (an error), not answer `None` as if it were
/// merely not due (`None` is documented for: not due, another rotation, the slot busy, a
/// backlog, a backend without a ring). Enqueues fail meanwhile (their trigger reads no slot).
#[test]
fn mysql_a_rotation_without_its_ring_row_is_an_error() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute("DELETE FROM tenure_ready_ring").unwrap();
    let enqueued = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]));
    println!("an enqueue without the ring row: {enqueued:?}");
    let rotated = jobs::rotate_ready(&mut conn, NO_WAIT);
    assert!(
        rotated.is_err(),
        "a forced rotation without the ring's row: {rotated:?}"
    );
}

/// An application's own `UPDATE` of a waiting job's id (a renumbering, a merge of two
/// databases' jobs): the update trigger compares the claim columns but not the id, so the
/// entry keeps the old id, which no job has; the job itself has none and is never claimed.
#[test]
fn mysql_an_applications_update_of_a_waiting_jobs_id_moves_its_entry() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let renumbered = id + 1000;
    conn.batch_execute(&format!(
        "UPDATE tenure_jobs SET id = {renumbered} WHERE id = {id}"
    ))
    .unwrap();
    let taken: Vec<i64> = jobs::claim(&mut conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    println!("a claim after the renumbering took {taken:?}");
    assert_ring_exact(&mut conn, backend, "after a waiting job's id changed");
}

/// A bulk enqueue writes its chunks' entries itself and the ring's trigger passes its rows
/// by (`ready_entry_by_insert`); every other insert still gets its entry from the trigger: an
/// older tenure running beside this one after the migration (its inserts name no such
/// column), one row or many. Each job has exactly one entry and is claimed once.
#[test]
fn mysql_inserts_that_write_no_entry_of_their_own_get_one_from_the_trigger() {
    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // Three chunks of a bulk (1,000 rows a statement), a rotation between two bulks.
    let bulk = vec![NewJob::new("q", "a", vec![]); 2_500];
    jobs::enqueue_many(&mut conn, &bulk).unwrap();
    jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    jobs::enqueue_many(&mut conn, &bulk[..10]).unwrap();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE ready_entry_by_insert"
        ),
        2_510
    );
    insert_job_as_before(&mut conn);
    conn.batch_execute(
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, \
         due_at, created_at) VALUES \
         ('q', 'a', 'x', 0, 'waiting', 0, 25, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)), \
         ('q', 'a', 'y', 0, 'waiting', 0, 25, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
    )
    .unwrap();
    assert_ring_exact(&mut conn, backend, "after bulk and older inserts");
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_ready"),
        2_513
    );
    let mut claimed = std::collections::HashSet::new();
    loop {
        let batch = jobs::claim(&mut conn, "q", 500, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        for job in batch {
            assert!(claimed.insert(job.id), "job {} claimed twice", job.id);
        }
    }
    assert_eq!(claimed.len(), 2_513);
    assert_ring_exact(&mut conn, backend, "after the drain");
}

/// A job inserted as the layout before the ring wrote it (this build's enqueue writes
/// columns a later migration adds); its id.
fn insert_job_as_before(conn: &mut tenure::AnyConnection) -> i64 {
    conn.batch_execute(
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, \
         due_at, created_at) VALUES ('q', 'a', 'x', 0, 'waiting', 0, 25, UTC_TIMESTAMP(6), \
         UTC_TIMESTAMP(6))",
    )
    .unwrap();
    count(conn, "SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS n")
}

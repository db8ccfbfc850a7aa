//! How a rescue judges a registered worker (`tenure_workers`, see `tenure::schema`): by its lock,
//! which the worker holds for its life, on a connection (a session) of its own on a server,
//! by a `flock` of its lock file on SQLite. Here the test is the worker, on connections and
//! files of its own, following the documented protocol; another connection rescues.
//!
//! A worker whose lock is held is never rescued, however silent; one whose session ended is
//! rescued (on a server once its lock has been found free for a few seconds and it is
//! silent); a server worker with a fresh heartbeat is never rescued, lock or not; two
//! rescuers take a dead worker's claims back once.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobState, NewJob};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count, race, wait_until};

conformance!(
    a_worker_registers_and_leaves_no_row_behind,
    a_worker_whose_lock_is_held_is_never_rescued,
    a_worker_whose_session_ended_is_rescued,
    two_rescuers_take_a_dead_workers_claims_back_once,
);

#[cfg(feature = "postgres")]
mod postgres_heartbeats {
    #[test]
    fn a_worker_with_a_fresh_heartbeat_is_not_rescued_without_its_lock() {
        super::a_worker_with_a_fresh_heartbeat_is_not_rescued_without_its_lock(
            tenure::Backend::Postgres,
        )
    }
}

#[cfg(feature = "mysql")]
mod mysql_heartbeats {
    #[test]
    fn a_worker_with_a_fresh_heartbeat_is_not_rescued_without_its_lock() {
        super::a_worker_with_a_fresh_heartbeat_is_not_rescued_without_its_lock(
            tenure::Backend::Mysql,
        )
    }
}

const TTL: Duration = Duration::from_secs(600);

/// The database's clock `seconds` ago, as SQL.
fn ago(backend: Backend, seconds: u32) -> String {
    match backend {
        Backend::Postgres => format!("statement_timestamp() - interval '{seconds} seconds'"),
        Backend::Mysql => format!("UTC_TIMESTAMP(6) - INTERVAL {seconds} SECOND"),
        Backend::Sqlite => format!("strftime('%Y-%m-%d %H:%M:%f','now','-{seconds} seconds')"),
    }
}

/// A worker of the test's own: its row, and its lock held by `session` (servers) or by a
/// file lock (SQLite), as a worker registers.
struct FakeWorker {
    id: i64,
    session: Option<AnyConnection>,
    #[cfg(all(feature = "sqlite", unix))]
    file: Option<std::fs::File>,
}

impl FakeWorker {
    /// Registers, silent for an hour (its heartbeat that old), its lock held.
    fn register(db: &TestDb) -> FakeWorker {
        let backend = db.backend;
        let mut session = db.connect();
        let hour = ago(backend, 3600);
        session
            .batch_execute(&format!(
                "INSERT INTO tenure_workers (host, pid, started_at, heartbeat_at) \
                 VALUES ('test', 1, {hour}, {hour})"
            ))
            .unwrap();
        let id = count(&mut session, "SELECT MAX(id) AS n FROM tenure_workers");
        let lock = match backend {
            Backend::Postgres => Some(format!(
                "SELECT CAST(1 AS BIGINT) AS n FROM (SELECT pg_advisory_lock(1952804469, {id})) l"
            )),
            Backend::Mysql => Some(format!(
                "SELECT CAST(GET_LOCK(CONCAT('tenure.w.', MD5(DATABASE()), '.', {id}), 0) AS SIGNED) AS n"
            )),
            Backend::Sqlite => None,
        };
        if let Some(lock) = lock {
            assert_eq!(count(&mut session, &lock), 1, "the worker's lock");
        }
        FakeWorker {
            id,
            session: (backend != Backend::Sqlite).then_some(session),
            #[cfg(all(feature = "sqlite", unix))]
            file: (backend == Backend::Sqlite).then(|| lock_file(db.url(), id)),
        }
    }

    /// The worker's process ends: its session closes, its file lock goes.
    fn die(&mut self) {
        self.session = None;
        #[cfg(all(feature = "sqlite", unix))]
        {
            self.file = None;
        }
    }

    /// `n` jobs claimed by this worker.
    fn claims(&self, conn: &mut AnyConnection, n: usize) -> Vec<i64> {
        let batch: Vec<NewJob> = (0..n)
            .map(|_| NewJob::new("live", "k", vec![]).max_attempts(1))
            .collect();
        jobs::enqueue_many(conn, &batch).unwrap();
        let claimed: Vec<i64> = jobs::claim(conn, "live", n, TTL)
            .unwrap()
            .iter()
            .map(|job| job.id)
            .collect();
        assert_eq!(claimed.len(), n);
        let list = claimed
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        conn.batch_execute(&format!(
            "UPDATE tenure_jobs SET claimed_by = {} WHERE id IN ({list})",
            self.id
        ))
        .unwrap();
        claimed
    }
}

/// The worker's lock file, created and locked as a worker does (`<database>-workers/<id>`).
#[cfg(all(feature = "sqlite", unix))]
fn lock_file(database: &str, id: i64) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let dir = format!("{database}-workers");
    std::fs::create_dir_all(&dir).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(format!("{dir}/{id}"))
        .unwrap();
    // SAFETY: flock on a descriptor the File owns.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(locked, 0, "the worker's lock file");
    file
}

fn rescued(conn: &mut AnyConnection) -> Vec<i64> {
    let rescued = jobs::rescue(conn, 100).unwrap();
    assert!(rescued.dead.is_empty() && rescued.cancelled.is_empty());
    rescued.requeued
}

fn running(conn: &mut AnyConnection, ids: &[i64]) -> bool {
    ids.iter()
        .all(|id| jobs::get(conn, *id).unwrap().unwrap().state == JobState::Running)
}

/// A worker registers when it starts (its row, its lock), its claims record it, it writes its
/// heartbeat every second; its shutdown deletes its row and releases its lock. A run still in
/// its handler past the grace period keeps its claim under the ttl alone (no longer the
/// worker's: nothing would tell its end), as before workers registered.
fn a_worker_registers_and_leaves_no_row_behind(backend: Backend) {
    use std::sync::{Arc, Mutex};
    use tenure::worker::{JobContext, Worker};
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("reg", "k", vec![]))
        .unwrap()
        .id;
    let gate = Arc::new(Mutex::new(()));
    let held = gate.lock().unwrap();
    let inside = gate.clone();
    let worker = Worker::builder(db.pool(6))
        .queue("reg")
        .threads(2)
        .claim_ttl(TTL)
        .raw_handler("k", move |_: &JobContext, _: &[u8]| {
            drop(inside.lock());
            Ok(())
        })
        .start()
        .unwrap();
    wait_until(
        &format!("job {id} to be claimed"),
        Duration::from_secs(20),
        || (jobs::get(&mut conn, id).unwrap().unwrap().state == JobState::Running).then_some(()),
    );
    let registered = count(&mut conn, "SELECT MAX(id) AS n FROM tenure_workers");
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id} AND claimed_by = {registered}"
            )
        ),
        1,
        "the claim records its worker"
    );
    let started = count(
        &mut conn,
        &format!(
            "SELECT COUNT(*) AS n FROM tenure_workers WHERE id = {registered} AND heartbeat_at > started_at"
        ),
    );
    let session = crate::common::worker_lock_session(&mut conn, backend, registered);
    std::thread::sleep(Duration::from_millis(2500));
    // One session holds its lock all along (the worker's checks find it held).
    assert_eq!(
        crate::common::worker_lock_session(&mut conn, backend, registered),
        session
    );
    if backend != Backend::Sqlite {
        assert!(session.is_some(), "a session holds the worker's lock");
    }
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_workers WHERE id = {registered} AND heartbeat_at > started_at"
            )
        ),
        1,
        "it writes its heartbeat (before: {started})"
    );
    #[cfg(all(feature = "sqlite", unix))]
    let file = format!("{}-workers/{registered}", db.url());
    #[cfg(all(feature = "sqlite", unix))]
    if backend == Backend::Sqlite {
        assert!(std::path::Path::new(&file).exists(), "its lock file");
    }
    // The handler runs past the grace period.
    worker.shutdown(Duration::ZERO);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_workers"),
        0,
        "its row is gone"
    );
    #[cfg(all(feature = "sqlite", unix))]
    if backend == Backend::Sqlite {
        assert!(
            !std::path::Path::new(&file).exists(),
            "its lock file is gone"
        );
    }
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Running, "still in its handler");
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE id = {id} AND claimed_by IS NULL"
            )
        ),
        1,
        "its claim keeps only its ttl"
    );
    assert_eq!(rescued(&mut conn), Vec::<i64>::new());
    drop(held);
}

/// A registered worker silent for an hour, whose lock was even marked free long ago (as if
/// it had been found free once), but whose lock its session holds: rescues leave its claims
/// alone (and clear the mark). A stopped or paused process holds its lock.
fn a_worker_whose_lock_is_held_is_never_rescued(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let worker = FakeWorker::register(&db);
    let claims = worker.claims(&mut conn, 3);
    conn.batch_execute(&format!(
        "UPDATE tenure_workers SET lock_free_since = {} WHERE id = {}",
        ago(backend, 3600),
        worker.id
    ))
    .unwrap();
    let mut rescuer = db.connect();
    for _ in 0..3 {
        assert_eq!(rescued(&mut rescuer), Vec::<i64>::new());
    }
    assert!(running(&mut conn, &claims));
    if backend != Backend::Sqlite {
        // (SQLite never marks: its lock alone decides.)
        assert_eq!(
            count(
                &mut conn,
                &format!(
                    "SELECT COUNT(*) AS n FROM tenure_workers WHERE id = {} AND lock_free_since IS NULL",
                    worker.id
                )
            ),
            1,
            "the rescue found the lock held and cleared the mark"
        );
    }
    drop(worker);
}

/// A registered worker's session ends (its process died): its claims come back, without
/// using an attempt (one lapse, the death in their history), and its row goes. On a server
/// only once a rescue has found its lock free for a few seconds (a live worker whose
/// session ended takes its lock again within them); on SQLite at once (only the process's
/// end frees a file lock). A plain claim (no worker) and another live worker's claim are
/// left alone.
fn a_worker_whose_session_ended_is_rescued(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut dead = FakeWorker::register(&db);
    let live = FakeWorker::register(&db);
    let claims = dead.claims(&mut conn, 3);
    let live_claims = live.claims(&mut conn, 1);
    jobs::enqueue(&mut conn, &NewJob::new("plain", "k", vec![])).unwrap();
    let plain = jobs::claim(&mut conn, "plain", 1, TTL).unwrap()[0].id;
    dead.die();
    let mut rescuer = db.connect();
    let died = std::time::Instant::now();
    let mut rescues = 0;
    let back = loop {
        let back = rescued(&mut rescuer);
        rescues += 1;
        if !back.is_empty() || rescues > 100 {
            break back;
        }
        if backend != Backend::Sqlite {
            // Not yet: its lock has not been free for long enough.
            assert!(running(&mut conn, &claims));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(back, claims, "the dead worker's claims, and only those");
    let took = died.elapsed();
    let first_look_found = if backend == Backend::Sqlite {
        assert_eq!(rescues, 1, "SQLite: at the first look");
        "at the first look".to_string()
    } else {
        // Its lock found free for 3 s (by the database's clock) first.
        assert!(
            took > Duration::from_millis(2500),
            "taken back after {took:?}"
        );
        format!("after {rescues} looks, {took:.1?}")
    };
    for id in &claims {
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        assert_eq!(
            (job.state, job.attempt, job.lapses),
            (JobState::Waiting, 0, 1)
        );
        assert!(
            job.last_error
                .as_deref()
                .is_some_and(|e| e.contains("worker holding the claim died")),
            "{:?}",
            job.last_error
        );
    }
    assert!(running(&mut conn, &live_claims) && running(&mut conn, &[plain]));
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_workers WHERE id = {}",
                dead.id
            )
        ),
        0,
        "the dead worker's row is gone"
    );
    #[cfg(all(feature = "sqlite", unix))]
    if backend == Backend::Sqlite {
        let file = format!("{}-workers/{}", db.url(), dead.id);
        assert!(
            !std::path::Path::new(&file).exists(),
            "its lock file is gone"
        );
    }
    println!("{backend}: a dead worker's 3 claims came back {first_look_found}");
    drop(live);
}

/// A server worker whose session ended but whose heartbeat is fresh (its lock connection
/// was lost, the worker goes on through its others) is not rescued, however long its lock
/// has been free; once it is silent too, it is.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn a_worker_with_a_fresh_heartbeat_is_not_rescued_without_its_lock(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut worker = FakeWorker::register(&db);
    let claims = worker.claims(&mut conn, 2);
    worker.die();
    let set = |conn: &mut AnyConnection, heartbeat: &str| {
        conn.batch_execute(&format!(
            "UPDATE tenure_workers SET heartbeat_at = {heartbeat}, lock_free_since = {} WHERE id = {}",
            ago(backend, 3600),
            worker.id
        ))
        .unwrap();
    };
    let now = crate::common::now_sql(backend);
    let mut rescuer = db.connect();
    for _ in 0..10 {
        set(&mut conn, now);
        assert_eq!(rescued(&mut rescuer), Vec::<i64>::new());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(running(&mut conn, &claims));
    set(&mut conn, &ago(backend, 60));
    let mut back = Vec::new();
    for _ in 0..50 {
        back = rescued(&mut rescuer);
        if !back.is_empty() {
            break;
        }
        // Its session's end may take a moment to reach the server.
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(back, claims);
}

/// Four rescuers at once, on a dead worker holding 50 claims: each claim comes back once.
fn two_rescuers_take_a_dead_workers_claims_back_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut worker = FakeWorker::register(&db);
    let claims = worker.claims(&mut conn, 50);
    worker.die();
    conn.batch_execute(&format!(
        "UPDATE tenure_workers SET lock_free_since = {} WHERE id = {}",
        ago(backend, 3600),
        worker.id
    ))
    .unwrap();
    // Its session's end reaches the server.
    std::thread::sleep(Duration::from_millis(300));
    let results = race(&db, 4, |_, conn| {
        let mut back = Vec::new();
        for _ in 0..5 {
            back.extend(jobs::rescue(conn, 100).unwrap().requeued);
        }
        back
    });
    let mut all: Vec<i64> = results.into_iter().flatten().collect();
    all.sort_unstable();
    assert_eq!(all, claims, "each claim came back once");
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses = 1 AND state = 'waiting'"
        ),
        50
    );
}

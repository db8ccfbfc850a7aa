//! The test harness shared by the three test binaries (`conformance`, `cli`, `faults`; each
//! includes this folder by `#[path]`): a fresh database per test on each backend, the macro
//! that instantiates every conformance test once per backend (`conformance!`), `concrete!`,
//! threads released together (`race`, `contest`), small queries, and the one deadline-bounded
//! wait (`wait_until`) every poll loop uses.

#[allow(dead_code)]
pub mod proxy;
mod wait;
pub use wait::{poll_until, wait_until};

use std::sync::{Arc, Barrier};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::{AnyConnection, Backend, Pool, SessionSetup};

const DEFAULT_POSTGRES_URL: &str = "postgres://root@127.0.0.1:5432/test";
const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// Instantiates each listed test, a `fn(Backend)` of the enclosing module, once per backend
/// whose feature is on: `<module>::sqlite::<test>`, `<module>::postgres::<test>`,
/// `<module>::mysql::<test>`.
macro_rules! conformance {
    ($($test:ident),+ $(,)?) => {
        #[cfg(feature = "sqlite")]
        mod sqlite {
            $(#[test] fn $test() { super::$test(tenure::Backend::Sqlite) })+
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(#[test] fn $test() { super::$test(tenure::Backend::Postgres) })+
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(#[test] fn $test() { super::$test(tenure::Backend::Mysql) })+
        }
    };
}
pub(crate) use conformance;

/// [`conformance!`] for a promise only the servers make (where a session can end while its
/// process lives): PostgreSQL and MySQL/MariaDB.
#[allow(unused_macros)]
macro_rules! on_servers {
    ($($test:ident),+ $(,)?) => {
        #[cfg(feature = "postgres")]
        mod postgres {
            $(#[test] fn $test() { super::$test(tenure::Backend::Postgres) })+
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(#[test] fn $test() { super::$test(tenure::Backend::Mysql) })+
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_servers;

/// Runs `$body` with `$c` bound to the concrete diesel connection behind `$conn`, for SQL that
/// uses tenure's SQL types (which diesel's multi-connection backend does not know).
macro_rules! concrete {
    ($conn:expr, $c:ident => $body:expr) => {
        match tenure::TenureConnection::backend_connection($conn) {
            #[cfg(feature = "sqlite")]
            tenure::BackendConnection::Sqlite($c) => $body,
            #[cfg(feature = "postgres")]
            tenure::BackendConnection::Postgres($c) => $body,
            #[cfg(feature = "mysql")]
            tenure::BackendConnection::Mysql($c) => $body,
            #[allow(unreachable_patterns)]
            _ => unreachable!("a backend this build does not have"),
        }
    };
}
pub(crate) use concrete;

/// The server URL a backend's tests use (from the environment, or the local default).
pub fn server_url(backend: Backend) -> String {
    match backend {
        Backend::Postgres => std::env::var("TENURE_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| DEFAULT_POSTGRES_URL.to_string()),
        Backend::Mysql => {
            std::env::var("TENURE_TEST_MYSQL_URL").unwrap_or_else(|_| DEFAULT_MYSQL_URL.to_string())
        }
        Backend::Sqlite => unreachable!("SQLite has no server"),
    }
}

/// Connects to `url`, waiting out a full server ("too many clients": the suite's parallel
/// races hold many connections each) for up to a minute; any other failure is returned at
/// once.
fn connect_when_room(url: &str) -> Result<AnyConnection, tenure::Error> {
    when_room(|| AnyConnection::connect(url))
}

fn when_room(
    connect: impl Fn() -> Result<AnyConnection, tenure::Error>,
) -> Result<AnyConnection, tenure::Error> {
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match connect() {
            Err(e)
                if std::time::Instant::now() < give_up
                    && (format!("{e:?}").contains("too many clients")
                        || format!("{e:?}").contains("Too many connections")) =>
            {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

/// A database of its own for one test, dropped afterwards: `tenure_t_<random>` on a server, a
/// file in a temporary directory on SQLite (not `:memory:`, which gives each connection its
/// own database).
pub struct TestDb {
    pub backend: Backend,
    url: String,
    server: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl TestDb {
    /// An empty database. Panics, naming the server and the variable to set, when the
    /// backend's server cannot be reached: a backend is never skipped silently.
    pub fn empty(backend: Backend) -> TestDb {
        let var = if backend == Backend::Postgres {
            "TENURE_TEST_POSTGRES_URL"
        } else {
            "TENURE_TEST_MYSQL_URL"
        };
        let server = (backend != Backend::Sqlite).then(|| server_url(backend));
        TestDb::empty_on(backend, server, var)
    }

    /// A migrated database on the server a test may restart and whose connections it may
    /// kill: never the one the other tests share, but the private server `scripts/test`
    /// starts (`TENURE_TEST_RESTARTABLE_POSTGRES_URL`, `TENURE_TEST_RESTARTABLE_MYSQL_URL`).
    /// Panics when the variable is unset.
    #[allow(dead_code)]
    pub fn restartable(backend: Backend) -> TestDb {
        let var = if backend == Backend::Postgres {
            "TENURE_TEST_RESTARTABLE_POSTGRES_URL"
        } else {
            "TENURE_TEST_RESTARTABLE_MYSQL_URL"
        };
        let server = std::env::var(var).unwrap_or_else(|_| {
            panic!(
                "{var} is unset: it names the private {backend} server this test may restart \
                 (scripts/test starts one: scripts/private-servers)"
            )
        });
        let db = TestDb::empty_on(backend, Some(server), var);
        let mut conn = db.connect();
        tenure::run_migrations(&mut conn).expect("tenure's migrations");
        db
    }

    /// An empty database on `server` (`None` for SQLite); `var` names where its URL came from.
    fn empty_on(backend: Backend, server: Option<String>, var: &str) -> TestDb {
        let Some(server) = server else {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let url = dir.path().join("tenure-test.db").display().to_string();
            return TestDb {
                backend,
                url,
                server: None,
                _dir: Some(dir),
            };
        };
        let name = format!("tenure_t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = connect_when_room(&server).unwrap_or_else(|e| {
            panic!(
                "the {backend} test server is unreachable ({e}). Start it (see README.md) or \
                 point {var} at one; tests never skip a backend."
            )
        });
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create the test database");
        let mut url = url::Url::parse(&server).expect("a valid server URL");
        url.set_path(&name);
        TestDb {
            backend,
            url: url.to_string(),
            server: Some((server, name)),
            _dir: None,
        }
    }

    /// A database with tenure's migrations applied.
    pub fn migrated(backend: Backend) -> TestDb {
        let db = TestDb::empty(backend);
        let mut conn = db.connect();
        tenure::run_migrations(&mut conn).expect("tenure's migrations");
        db
    }

    #[allow(dead_code)]
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A new connection with tenure's session settings (which `AnyConnection::connect`
    /// applies).
    pub fn connect(&self) -> AnyConnection {
        connect_when_room(&self.url)
            .unwrap_or_else(|e| panic!("connect to the test database: {e:?}"))
    }

    /// A new connection without any session settings, as a user's own connection may be.
    pub fn connect_raw(&self) -> AnyConnection {
        when_room(|| AnyConnection::connect_raw(&self.url))
            .unwrap_or_else(|e| panic!("connect to the test database: {e:?}"))
    }

    /// A new connection with these session settings.
    #[allow(dead_code)]
    pub fn connect_with(&self, setup: &SessionSetup) -> AnyConnection {
        let mut conn = self.connect_raw();
        setup.apply(&mut conn).expect("session settings");
        conn
    }

    pub fn pool(&self, max_size: u32) -> Pool {
        Pool::options()
            .max_size(max_size)
            .open(&self.url)
            .expect("open a pool on the test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some((server, name)) = &self.server {
            let sql = match self.backend {
                Backend::Postgres => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                _ => format!("DROP DATABASE IF EXISTS {name}"),
            };
            match connect_when_room(server) {
                Ok(mut admin) => {
                    if let Err(e) = admin.batch_execute(&sql) {
                        eprintln!("could not drop test database {name}: {e}");
                    }
                }
                Err(e) => eprintln!("could not drop test database {name}: {e}"),
            }
        }
    }
}

/// Runs `f` on `n` threads released together by a barrier, each with its own connection, and
/// returns their results in thread order.
pub fn race<T: Send + 'static>(
    db: &TestDb,
    n: usize,
    f: impl Fn(usize, &mut AnyConnection) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let mut conn = db.connect();
            let (f, barrier) = (f.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                f(i, &mut conn)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a racing thread panicked"))
        .collect()
}

/// Counts rows with a query returning one BIGINT column named `n`.
pub fn count(conn: &mut AnyConnection, sql: &str) -> i64 {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query(sql)
        .get_result::<N>(conn)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .n
}

/// The session holding worker `id`'s liveness lock in this test's database (PostgreSQL: the
/// backend's pid; MariaDB: the connection id), if one does; `None` on SQLite (a file lock).
/// `pg_locks` lists the locks of every database, and worker ids repeat across the tests'
/// databases: without the filter on the database, another test's worker of the same id
/// answered (a "relocked" session that was never this worker's).
pub fn worker_lock_session(conn: &mut AnyConnection, backend: Backend, id: i64) -> Option<i64> {
    let query = match backend {
        Backend::Postgres => format!(
            "SELECT CAST(COALESCE(MAX(pid), 0) AS BIGINT) AS n FROM pg_locks \
             WHERE locktype = 'advisory' AND classid = 1952804469 AND objid = {id} \
             AND objsubid = 2 AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        Backend::Mysql => format!(
            "SELECT CAST(COALESCE(IS_USED_LOCK(CONCAT('tenure.w.', MD5(DATABASE()), '.', {id})), 0) AS SIGNED) AS n"
        ),
        Backend::Sqlite => return None,
    };
    Some(count(conn, &query)).filter(|session| *session != 0)
}

/// The SQL column type of `tenure::sql_types::Instant` on a backend.
pub fn instant_column(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => "TEXT",
        Backend::Postgres => "timestamptz",
        Backend::Mysql => "DATETIME(6)",
    }
}

/// The SQL column type of `tenure::sql_types::Token` on a backend.
pub fn token_column(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => "BLOB",
        Backend::Postgres => "uuid",
        Backend::Mysql => "BINARY(16)",
    }
}

/// `n` bind placeholders for a backend: `$1, $2` on PostgreSQL, `?, ?` elsewhere.
pub fn placeholders(backend: Backend, n: usize) -> String {
    (1..=n)
        .map(|i| match backend {
            Backend::Postgres => format!("${i}"),
            _ => "?".to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs `rounds` rounds of a contest between `n` threads, each on its own connection kept
/// across rounds. In each round the threads are released together by a barrier and call
/// `attempt(round, thread)`; then `judge` runs alone, with every thread's result, before the
/// next round starts.
pub fn contest<T: Send + 'static>(
    db: &TestDb,
    n: usize,
    rounds: usize,
    attempt: impl Fn(usize, usize, &mut AnyConnection) -> T + Send + Sync + 'static,
    mut judge: impl FnMut(usize, Vec<T>),
) {
    let attempt = Arc::new(attempt);
    let start = Arc::new(Barrier::new(n + 1));
    let (sender, results) = std::sync::mpsc::channel::<(usize, T)>();
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let mut conn = db.connect();
            let (attempt, start, sender) = (attempt.clone(), start.clone(), sender.clone());
            std::thread::spawn(move || {
                for round in 0..rounds {
                    start.wait();
                    let outcome = attempt(round, i, &mut conn);
                    if sender.send((i, outcome)).is_err() {
                        return;
                    }
                }
            })
        })
        .collect();
    drop(sender);
    for round in 0..rounds {
        start.wait();
        let mut outcomes: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let (i, outcome) = results.recv().expect("a contender died");
            outcomes[i] = Some(outcome);
        }
        judge(
            round,
            outcomes
                .into_iter()
                .map(|o| o.expect("one result per thread"))
                .collect(),
        );
    }
    for thread in threads {
        thread.join().expect("a contender panicked");
    }
}

/// The database clock as SQL, for tests that write their own statements.
pub fn now_sql(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => "strftime('%Y-%m-%d %H:%M:%f','now')",
        Backend::Postgres => "statement_timestamp()",
        Backend::Mysql => "UTC_TIMESTAMP(6)",
    }
}

/// Handler runs as (job id, start, end), by this process's clock.
pub type Intervals = Arc<std::sync::Mutex<Vec<(i64, std::time::Instant, std::time::Instant)>>>;

/// The pairs of runs (by job id) whose intervals overlap.
pub fn overlaps(intervals: &[(i64, std::time::Instant, std::time::Instant)]) -> Vec<(i64, i64)> {
    let mut found = Vec::new();
    for (i, a) in intervals.iter().enumerate() {
        for b in &intervals[i + 1..] {
            if a.1 < b.2 && b.1 < a.2 {
                found.push((a.0, b.0));
            }
        }
    }
    found
}

/// Waits until `done(report)` or `limit` passes; returns the last report.
pub fn wait_for(
    worker: &tenure::worker::WorkerHandle,
    limit: std::time::Duration,
    done: impl Fn(&tenure::worker::Report) -> bool,
) -> tenure::worker::Report {
    let mut last = None;
    poll_until(limit, std::time::Duration::from_millis(10), || {
        let report = worker.report();
        if done(&report) {
            return Some(report);
        }
        last = Some(report);
        None
    })
    .unwrap_or_else(|| last.expect("at least one report"))
}

/// Sends tenure's warnings (and worse) to this test's stderr, which nextest shows when the
/// test fails (a worker's "heartbeat failed" says why a run was lost), and keeps them for the
/// test to wait on ([`Warnings`]). Each test runs in its own process under nextest, so the
/// global subscriber is the test's.
#[allow(dead_code)]
pub fn show_warnings() -> Warnings {
    use tracing_subscriber::Layer;
    use tracing_subscriber::filter::LevelFilter;
    use tracing_subscriber::layer::SubscriberExt;
    let seen = Warnings::default();
    let subscriber = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // `TENURE_TEST_LOG=debug` shows tenure's debug lines too (run by hand).
                .with_filter(match std::env::var("TENURE_TEST_LOG").as_deref() {
                    Ok("debug") => LevelFilter::DEBUG,
                    _ => LevelFilter::WARN,
                }),
        )
        .with(seen.clone().with_filter(LevelFilter::WARN));
    let _ = tracing::subscriber::set_global_default(subscriber);
    seen
}

/// The warnings tenure logged in this test, each as its fields (`message` among them).
#[derive(Clone, Default)]
#[allow(dead_code)]
pub struct Warnings(Arc<std::sync::Mutex<Vec<std::collections::HashMap<String, String>>>>);

#[allow(dead_code)]
impl Warnings {
    /// The distinct values of `field` among the warnings whose message is `message`.
    pub fn values_of(&self, message: &str, field: &str) -> std::collections::BTreeSet<String> {
        let seen = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.iter()
            .filter(|w| w.get("message").map(String::as_str) == Some(message))
            .filter_map(|w| w.get(field).cloned())
            .collect()
    }

    /// The distinct values of `field` among all the warnings that have it.
    pub fn values_of_field(&self, field: &str) -> std::collections::BTreeSet<String> {
        let seen = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.iter().filter_map(|w| w.get(field).cloned()).collect()
    }
}

struct Fields<'a>(&'a mut std::collections::HashMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").trim_matches('"').to_string(),
        );
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = std::collections::HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(fields);
    }
}

/// Waits until no job of the database is waiting or running, or `limit` passes; returns how
/// many are left (0 once drained).
#[allow(dead_code)]
pub fn live_jobs_after(conn: &mut AnyConnection, limit: std::time::Duration) -> i64 {
    let mut live = 0;
    poll_until(limit, std::time::Duration::from_millis(20), || {
        live = count(
            conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
        );
        (live == 0).then_some(())
    });
    live
}

/// Sleeps until the database's clock is past `at` (60 s at most): waits decided by the clock
/// that decides expiry, never by the client's.
#[allow(dead_code)]
pub fn wait_for_db_clock(conn: &mut AnyConnection, at: chrono::DateTime<chrono::Utc>) {
    wait_until(
        &format!("the database clock to pass {at}"),
        std::time::Duration::from_secs(60),
        || (tenure::database_now(conn).unwrap() > at).then_some(()),
    );
}

/// Claims the one due job of `kind` in `queue` (for 120 s); fails the test if the claim
/// takes any other number.
pub fn claim_one(conn: &mut AnyConnection, queue: &str, kind: &str) -> tenure::jobs::ClaimedJob {
    let mut claimed = tenure::jobs::claim_kinds(
        conn,
        queue,
        &[kind],
        10,
        std::time::Duration::from_secs(120),
    )
    .unwrap();
    assert_eq!(claimed.len(), 1, "claimed {claimed:?}");
    claimed.remove(0)
}

/// A job's state (the job must exist).
pub fn job_state(conn: &mut AnyConnection, id: i64) -> tenure::jobs::JobState {
    tenure::jobs::get(conn, id).unwrap().unwrap().state
}

/// Enqueues a job and gives its id.
pub fn enqueue_id(conn: &mut AnyConnection, job: tenure::jobs::NewJob) -> i64 {
    tenure::jobs::enqueue(conn, &job).unwrap().id
}

//! The harness's database, figures and process readings.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use tenure::{AnyConnection, Backend, Pool, TenureConnection};

/// A database of the run's own.
pub struct BenchDb {
    url: String,
    drop: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl BenchDb {
    pub fn new(backend: Backend) -> BenchDb {
        let server = match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("a temporary directory");
                let url = dir.path().join("bench.db").display().to_string();
                return BenchDb::migrated(url, None, Some(dir));
            }
            Backend::Postgres => std::env::var("TENURE_TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into()),
            Backend::Mysql => std::env::var("TENURE_TEST_MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
        };
        let name = format!("tenure_bench_{}", uuid::Uuid::new_v4().simple());
        let mut admin = AnyConnection::connect(&server)
            .unwrap_or_else(|e| panic!("cannot reach the {backend:?} server: {e}"));
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create the bench database");
        let mut url = url::Url::parse(&server).expect("a server URL");
        url.set_path(&name);
        BenchDb::migrated(url.to_string(), Some((server, name)), None)
    }

    fn migrated(
        url: String,
        drop: Option<(String, String)>,
        dir: Option<tempfile::TempDir>,
    ) -> Self {
        let mut conn = AnyConnection::connect(&url).expect("connect to the bench database");
        tenure::run_migrations(&mut conn).expect("migrations");
        BenchDb {
            url,
            drop,
            _dir: dir,
        }
    }

    /// A connection outside the pool with the same settings as the pool's (tenure's defaults:
    /// on SQLite WAL and a busy timeout, so it waits for the workers' writes instead of
    /// failing with "database is locked"). Checked, so no figure is ever measured without
    /// WAL again.
    pub fn connect(&self) -> AnyConnection {
        let mut conn = AnyConnection::connect(&self.url).expect("connect to the bench database");
        if conn.backend() == Backend::Sqlite {
            #[derive(diesel::QueryableByName)]
            struct Mode {
                #[diesel(sql_type = diesel::sql_types::Text)]
                journal_mode: String,
            }
            let mode: Mode = diesel::RunQueryDsl::get_result(
                diesel::sql_query("PRAGMA journal_mode"),
                &mut conn,
            )
            .expect("read the journal mode");
            assert_eq!(
                mode.journal_mode, "wal",
                "the bench runs SQLite in WAL mode"
            );
        }
        conn
    }

    /// The database's URL (on SQLite, its file's path).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn pool(&self, size: u32) -> Pool {
        Pool::options()
            .max_size(size)
            .open(&self.url)
            .expect("open a pool")
    }
}

impl Drop for BenchDb {
    fn drop(&mut self) {
        if let Some((server, name)) = &self.drop
            && let Ok(mut admin) = AnyConnection::connect(server)
        {
            let _ = admin.batch_execute(&format!("DROP DATABASE {name}"));
        }
    }
}

/// One workload's figures for one run.
#[derive(Clone, Copy, Default)]
pub struct Figures {
    pub jobs_per_s: f64,
    pub p50: Option<Duration>,
    pub p95: Option<Duration>,
}

pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Some(sorted[i])
}

pub fn with_latencies(jobs_per_s: f64, mut latencies: Vec<Duration>) -> Figures {
    latencies.sort();
    Figures {
        jobs_per_s,
        p50: percentile(&latencies, 0.5),
        p95: percentile(&latencies, 0.95),
    }
}

/// User + system CPU time of this process, in seconds (0 where /proc has none).
pub fn cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // Fields after the command name (which is in parentheses): utime is the 12th.
            let rest = &stat[stat.rfind(')')? + 2..];
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let ticks: f64 =
                fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
}

/// `VmHWM` (peak) or `VmRSS` (now) of this process, in bytes (0 where /proc has none).
pub fn resident_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with(field))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

pub fn median(mut runs: Vec<Figures>) -> Figures {
    runs.sort_by(|a, b| a.jobs_per_s.total_cmp(&b.jobs_per_s));
    let mid = runs[runs.len() / 2];
    let mut p50: Vec<Duration> = runs.iter().filter_map(|r| r.p50).collect();
    let mut p95: Vec<Duration> = runs.iter().filter_map(|r| r.p95).collect();
    p50.sort();
    p95.sort();
    Figures {
        jobs_per_s: mid.jobs_per_s,
        p50: p50.get(p50.len() / 2).copied(),
        p95: p95.get(p95.len() / 2).copied(),
    }
}

pub fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| {
        format!("{:.2} ms", d.as_secs_f64() * 1000.0)
    })
}

pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024 / 1024);
    format!("{cores} cores ({cpu}), {mem} GiB")
}

//! G: steady state with a pinned snapshot. A producer enqueues at a fixed rate below
//! capacity (one job a transaction), a 4-thread worker keeps up and prunes completed jobs
//! (retention: keep those younger than 10 s), and the run has three phases: clean; a
//! transaction holding a snapshot open (PostgreSQL: REPEATABLE READ, which pins the xmin
//! horizon so vacuum reclaims nothing; MariaDB: a consistent snapshot, which stops purge;
//! SQLite: a read transaction, which stops the WAL from being checkpointed past it);
//! released. Every window prints pickup (enqueue -> handler start) p50/p99, the queue's
//! depth, dead row versions and the table's size.
//!
//! Q: `jobs::queue_depth` against `stats` with 1,000,000 jobs waiting.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use tenure::jobs::{self, Finished, NewJob, Retention};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend};

use crate::chart::{self, Series};
use crate::support::{BenchDb, Figures, ms, percentile, with_latencies};

/// G's shape: seconds of each of the clean and released phases, of the pinned one (twice
/// a phase unless given: the ten-minute hold runs with one-minute phases), jobs a
/// second, and the length of a reporting window.
pub struct Steady {
    pub phase_secs: u64,
    pub hold_secs: Option<u64>,
    pub rate: u64,
    pub window_secs: u64,
}

/// PostgreSQL's `autovacuum` setting on the server the run measures.
pub fn autovacuum(conn: &mut AnyConnection) -> String {
    #[derive(diesel::QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    diesel::sql_query("SELECT current_setting('autovacuum') AS value")
        .get_result::<Setting>(conn)
        .map_or_else(|e| e.to_string(), |s| s.value)
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn number(conn: &mut AnyConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<N>(conn)
        .map(|r| r.n)
        .unwrap_or(-1)
}

/// (dead row versions, or the backend's closest reading; bytes of table and indexes).
pub fn table_readings(
    conn: &mut AnyConnection,
    backend: Backend,
    sqlite_path: Option<&str>,
) -> (i64, i64) {
    match backend {
        Backend::Postgres => (
            number(
                conn,
                "SELECT COALESCE(SUM(n_dead_tup), 0)::bigint AS n FROM pg_stat_user_tables \
                 WHERE relname LIKE 'tenure\\_%'",
            ),
            number(
                conn,
                "SELECT COALESCE(SUM(pg_total_relation_size(relid)), 0)::bigint AS n \
                 FROM pg_stat_user_tables WHERE relname LIKE 'tenure\\_%'",
            ),
        ),
        Backend::Mysql => (
            // Undo records not yet purged: InnoDB's dead row versions.
            number(
                conn,
                "SELECT CAST(COUNT AS SIGNED) AS n FROM information_schema.INNODB_METRICS \
                 WHERE NAME = 'trx_rseg_history_len'",
            ),
            number(
                conn,
                "SELECT CAST(COALESCE(SUM(data_length + index_length), 0) AS SIGNED) AS n \
                 FROM information_schema.TABLES \
                 WHERE table_schema = DATABASE() AND table_name LIKE 'tenure\\_%'",
            ),
        ),
        Backend::Sqlite => {
            let size = |p: &str| std::fs::metadata(p).map_or(0, |m| m.len() as i64);
            let path = sqlite_path.unwrap_or_default();
            // The WAL's size stands for what a checkpoint could not yet write back.
            (size(&format!("{path}-wal")), size(path))
        }
    }
}

/// The ready ring's generation (how many rotations so far; servers only, -1 on SQLite).
pub fn ring_generation(conn: &mut AnyConnection, backend: Backend) -> i64 {
    match backend {
        Backend::Sqlite => -1,
        _ => number(conn, "SELECT generation AS n FROM tenure_ready_ring"),
    }
}

/// Holds a snapshot open on its own connection until dropped.
fn pin_snapshot(conn: &mut AnyConnection, backend: Backend) {
    let sql = match backend {
        Backend::Postgres => {
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT COUNT(*) FROM tenure_leases;"
        }
        Backend::Mysql => {
            "START TRANSACTION WITH CONSISTENT SNAPSHOT; SELECT COUNT(*) FROM tenure_leases;"
        }
        Backend::Sqlite => "BEGIN; SELECT COUNT(*) FROM tenure_jobs;",
    };
    conn.batch_execute(sql).expect("pin a snapshot");
}

pub fn steady(backend: Backend, shape: &Steady) {
    let db = Arc::new(BenchDb::new(backend));
    let pool = db.pool(8);
    let started_at = Instant::now();
    let pickups: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let sink = pickups.clone();
    let worker = Worker::builder(pool)
        .queue("bench")
        .threads(4)
        .retention(
            "bench",
            Finished::Completed,
            Retention::KeepYoungerThan(Duration::from_secs(10)),
        )
        .raw_handler("noop", move |_: &JobContext, payload: &[u8]| {
            let now = started_at.elapsed();
            let at = u64::from_le_bytes(payload.try_into().unwrap_or([0; 8]));
            sink.lock()
                .expect("lock")
                .push(now.saturating_sub(Duration::from_nanos(at)));
            Ok::<(), JobError>(())
        })
        .start()
        .expect("start the worker");
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (db, stop, rate) = (db.clone(), stop.clone(), shape.rate);
        std::thread::spawn(move || {
            let mut conn = db.connect();
            let tick = Duration::from_secs_f64(1.0 / rate as f64);
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let at = started_at.elapsed().as_nanos() as u64;
                let job = NewJob::new("bench", "noop", at.to_le_bytes().to_vec());
                jobs::enqueue(&mut conn, &job).expect("enqueue");
                next += tick;
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
        })
    };
    let mut watch = db.connect();
    let mut holder = db.connect();
    let sqlite_path = (backend == Backend::Sqlite).then(|| db.url().to_string());
    let hold_secs = shape.hold_secs.unwrap_or(shape.phase_secs * 2);
    let phases = [
        ("clean", shape.phase_secs),
        ("snapshot held", hold_secs),
        ("released", shape.phase_secs),
    ];
    let vacuum = if backend == Backend::Postgres {
        format!(", autovacuum {}", autovacuum(&mut watch))
    } else {
        String::new()
    };
    println!();
    println!(
        "G on {backend:?}: {} jobs/s, windows of {} s{vacuum}",
        shape.rate, shape.window_secs
    );
    println!(
        "| phase | t (s) | pickup p50 | pickup p99 | due depth | dead versions | size (MB) | rotations |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut summary: Vec<(&str, Vec<Duration>, i64)> = Vec::new();
    // (t, pickup p99 ms, dead versions, size MB) per window, for the chart.
    let mut series: Vec<(f64, f64, f64, f64)> = Vec::new();
    let mut held = (0.0, 0.0);
    for (phase, secs) in phases {
        if phase == "snapshot held" {
            held.0 = started_at.elapsed().as_secs_f64();
        }
        if phase == "released" {
            held.1 = started_at.elapsed().as_secs_f64();
        }
        if phase == "snapshot held" {
            pin_snapshot(&mut holder, backend);
        }
        if phase == "released" {
            holder
                .batch_execute("ROLLBACK")
                .expect("release the snapshot");
        }
        let mut phase_pickups = Vec::new();
        let mut peak_size = 0;
        let windows = (secs / shape.window_secs).max(1);
        for _ in 0..windows {
            std::thread::sleep(Duration::from_secs(shape.window_secs));
            let mut window: Vec<Duration> = std::mem::take(&mut *pickups.lock().expect("lock"));
            window.sort();
            let depth = jobs::queue_depth(&mut watch, "bench", jobs::MAX_DEPTH_BOUND)
                .map_or(-1, |d| d.due as i64);
            let (dead, size) = table_readings(&mut watch, backend, sqlite_path.as_deref());
            peak_size = peak_size.max(size);
            let rotations = ring_generation(&mut watch, backend);
            let p99 = percentile(&window, 0.99).map_or(0.0, |d| d.as_secs_f64() * 1000.0);
            series.push((
                started_at.elapsed().as_secs_f64(),
                p99,
                dead as f64,
                size as f64 / 1e6,
            ));
            println!(
                "| {phase} | {} | {} | {} | {depth} | {dead} | {:.1} | {rotations} |",
                started_at.elapsed().as_secs(),
                ms(percentile(&window, 0.5)),
                ms(percentile(&window, 0.99)),
                size as f64 / 1e6
            );
            phase_pickups.extend(window);
        }
        phase_pickups.sort();
        summary.push((phase, phase_pickups, peak_size));
    }
    stop.store(true, Ordering::Relaxed);
    producer.join().expect("the producer panicked");
    worker.shutdown(Duration::from_secs(10));
    let dead_label = match backend {
        Backend::Postgres => "dead row versions (n_dead_tup)",
        Backend::Mysql => "undo records not purged (history length)",
        Backend::Sqlite => "WAL bytes",
    };
    let column = |label: &str, pick: fn(&(f64, f64, f64, f64)) -> f64| Series {
        label: label.into(),
        points: series.iter().map(|w| (w.0, pick(w))).collect(),
    };
    let charted = chart::write(
        &format!("g-{backend:?}-{hold_secs}s").to_lowercase(),
        &format!(
            "G on {backend:?}: {} jobs/s, a snapshot held {} s{vacuum}",
            shape.rate, hold_secs
        ),
        &[
            column("pickup p99 (ms)", |w| w.1),
            column(dead_label, |w| w.2),
            column("tables and indexes (MB)", |w| w.3),
        ],
        Some((held.0, held.1, "snapshot held")),
    );
    match charted {
        Ok(path) => println!("G on {backend:?}: chart {}", path.display()),
        Err(e) => println!("G on {backend:?}: no chart ({e})"),
    }
    let clean_p99 = percentile(&summary[0].1, 0.99);
    for (phase, pickups, peak) in &summary {
        let p99 = percentile(pickups, 0.99);
        let ratio = match (p99, clean_p99) {
            (Some(p), Some(c)) if !c.is_zero() => {
                format!("{:.2}", p.as_secs_f64() / c.as_secs_f64())
            }
            _ => "-".into(),
        };
        println!(
            "G on {backend:?}, {phase}: pickup p50 {} p99 {} ({ratio}x clean), peak size {:.1} MB",
            ms(percentile(pickups, 0.5)),
            ms(p99),
            *peak as f64 / 1e6
        );
    }
}

/// Q. `queue_depth` (bound 10,000) and `stats`, per call, with 1,000,000 jobs waiting and
/// 1,000 running.
pub fn depth_calls(backend: Backend) -> (Figures, Figures) {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    for _ in 0..100 {
        let batch: Vec<NewJob> = (0..10_000)
            .map(|_| NewJob::new("bench", "noop", vec![]))
            .collect();
        jobs::enqueue_many(&mut conn, &batch).expect("fill");
    }
    jobs::claim(&mut conn, "bench", 1000, Duration::from_secs(3600)).expect("claim");
    if backend == Backend::Postgres {
        conn.batch_execute("VACUUM ANALYZE tenure_jobs")
            .expect("vacuum");
    }
    let time = |f: &mut dyn FnMut(), n: usize| {
        let mut latencies = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            f();
            latencies.push(t.elapsed());
        }
        with_latencies(0.0, latencies)
    };
    let mut depth_conn = db.connect();
    let depth = time(
        &mut || {
            jobs::queue_depth(&mut depth_conn, "bench", 10_000).expect("queue_depth");
        },
        200,
    );
    let stats = time(
        &mut || {
            jobs::stats(&mut conn).expect("stats");
        },
        5,
    );
    (depth, stats)
}

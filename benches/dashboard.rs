//! How long each page of `tenure serve` takes with a million jobs in the table.
//!
//! ```text
//! cargo bench --bench dashboard --all-features -- [--jobs N] [--samples N] [--backend B]
//!   --jobs N      jobs in the table (default 1,000,000)
//!   --samples N   requests per page, after one to warm up (default 20)
//!   --backend B   sqlite, postgres, mysql or all (default: all compiled in)
//!   --keep        keep the databases (their URLs are printed), to look at the plans
//! ```
//!
//! The table: 4 queues; 80% of the jobs completed over the last 30 minutes, 5% dead (with
//! errors), 1% cancelled, 100 running, the rest waiting. States are set by UPDATEs over id
//! ranges after the enqueue (a fixture, not a workload). PostgreSQL then vacuums and
//! analyses the table and MariaDB analyses it, as autovacuum or InnoDB's statistics would;
//! SQLite is left without statistics, as tenure leaves it. Each page is fetched over HTTP from a `tenure serve --threads 1`; the
//! figures are the whole request, as a browser waits for it.

#[path = "throughput/support.rs"]
#[allow(dead_code)]
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, JobState, NewJob};
use tenure::schema::tenure_jobs;
use tenure::sql_types::InstantValue;
use tenure::{Backend, lease};

use support::{BenchDb, percentile};

const QUEUES: [&str; 4] = ["mail", "reports", "billing", "sync"];

struct Options {
    jobs: i64,
    samples: usize,
    backends: Vec<Backend>,
    keep: bool,
}

fn options() -> Options {
    let mut options = Options {
        jobs: 1_000_000,
        samples: 20,
        keep: false,
        backends: vec![
            #[cfg(feature = "sqlite")]
            Backend::Sqlite,
            #[cfg(feature = "postgres")]
            Backend::Postgres,
            #[cfg(feature = "mysql")]
            Backend::Mysql,
        ],
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--jobs" => options.jobs = value().parse().expect("--jobs N"),
            "--samples" => options.samples = value().parse().expect("--samples N"),
            "--keep" => options.keep = true,
            "--backend" => {
                options.backends = match value().as_str() {
                    "sqlite" => vec![Backend::Sqlite],
                    "postgres" => vec![Backend::Postgres],
                    "mysql" | "mariadb" => vec![Backend::Mysql],
                    "all" => options.backends.clone(),
                    other => panic!("unknown backend {other:?}"),
                }
            }
            // A test runner listing every target's tests (`cargo nextest run
            // --all-targets`): this harness has none.
            "--list" => std::process::exit(0),
            "--format" => {
                let _ = value();
            }
            // `cargo bench` passes --bench; `cargo test --bench` passes nothing else.
            "--bench" | "--ignored" => {}
            other => panic!("unknown option {other:?} (see the comment at the top)"),
        }
    }
    options
}

/// Enqueues `n` jobs and sets their states over id ranges (see the crate docs above).
fn fill(db: &BenchDb, n: i64) -> i64 {
    let mut conn = db.connect();
    let started = Instant::now();
    let kinds = ["send", "render", "charge", "pull"];
    let mut done = 0;
    while done < n {
        let batch: Vec<NewJob> = (done..(done + 1000).min(n))
            .map(|i| {
                let q = (i % 4) as usize;
                NewJob::new(QUEUES[q], kinds[q], format!("{{\"n\":{i}}}").into_bytes())
            })
            .collect();
        done += batch.len() as i64;
        jobs::enqueue_many(&mut conn, &batch).expect("enqueue");
    }
    let first: i64 = tenure_jobs::table
        .select(diesel::dsl::min(tenure_jobs::id))
        .first::<Option<i64>>(&mut conn)
        .expect("min id")
        .unwrap_or(1);
    let now = tenure::database_now(&mut conn).expect("now");
    let at = |share: f64| first + (n as f64 * share) as i64;
    // Completed: 30 slices, one per minute of the last 30.
    let completed_end = at(0.80);
    let slice = (completed_end - first) / 30 + 1;
    for minute in 0..30 {
        let (from, to) = (
            first + minute * slice,
            (first + (minute + 1) * slice).min(completed_end),
        );
        let finished = now - chrono::Duration::minutes(29 - minute) - chrono::Duration::seconds(30);
        diesel::update(
            tenure_jobs::table.filter(tenure_jobs::id.ge(from).and(tenure_jobs::id.lt(to))),
        )
        .set((
            tenure_jobs::state.eq(JobState::Completed),
            tenure_jobs::attempt.eq(1),
            tenure_jobs::claimed_at.eq(InstantValue(finished - chrono::Duration::seconds(1))),
            tenure_jobs::finished_at.eq(InstantValue(finished)),
        ))
        .execute(&mut conn)
        .expect("complete");
    }
    let (dead_end, cancelled_end) = (at(0.85), at(0.86));
    diesel::update(
        tenure_jobs::table.filter(
            tenure_jobs::id
                .ge(completed_end)
                .and(tenure_jobs::id.lt(dead_end)),
        ),
    )
    .set((
        tenure_jobs::state.eq(JobState::Dead),
        tenure_jobs::attempt.eq(tenure_jobs::max_attempts),
        tenure_jobs::finished_at.eq(InstantValue(now - chrono::Duration::minutes(5))),
        tenure_jobs::last_error.eq("timeout after 30s talking to the upstream"),
    ))
    .execute(&mut conn)
    .expect("dead");
    diesel::update(
        tenure_jobs::table.filter(
            tenure_jobs::id
                .ge(dead_end)
                .and(tenure_jobs::id.lt(cancelled_end)),
        ),
    )
    .set((
        tenure_jobs::state.eq(JobState::Cancelled),
        tenure_jobs::finished_at.eq(InstantValue(now - chrono::Duration::minutes(7))),
    ))
    .execute(&mut conn)
    .expect("cancelled");
    for queue in QUEUES {
        jobs::claim(&mut conn, queue, 25, Duration::from_secs(3600)).expect("claim");
    }
    lease::try_take(
        &mut conn,
        "nightly-backup",
        Duration::from_secs(3600),
        "host-a",
    )
    .expect("lease");
    match tenure::TenureConnection::backend(&mut conn) {
        // What autovacuum does after such updates (this machine's PostgreSQL has it off):
        // without it every index still holds each job's first version.
        Backend::Postgres => conn
            .batch_execute("VACUUM ANALYZE tenure_jobs")
            .expect("vacuum"),
        Backend::Mysql => conn
            .batch_execute("ANALYZE TABLE tenure_jobs")
            .expect("analyze"),
        _ => {}
    }
    eprintln!("  filled {n} jobs in {:.0?}", started.elapsed());
    first + n / 2
}

/// One GET on a new connection, written in one packet with Nagle's delay off (a client that
/// writes its request in pieces would add the 40 ms of a delayed ACK to every figure); the
/// reply is read to its end. Returns the status.
fn fetch(base: &str, path: &str) -> u16 {
    use std::io::{Read, Write};
    let address = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .expect("send");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).expect("read");
    let head = String::from_utf8_lossy(&reply[..reply.len().min(16)]).to_string();
    head.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let options = options();
    println!(
        "tenure serve, {} jobs: milliseconds per page over HTTP ({} requests each, after a warm-up)",
        options.jobs, options.samples
    );
    for &backend in &options.backends {
        let db = BenchDb::new(backend);
        let middle = fill(&db, options.jobs);
        let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args([
                "--database-url",
                db.url(),
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--threads",
                "1",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run tenure serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("its first line");
        let base = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .expect("where it listens")
            .trim_end_matches('/')
            .to_string();
        let pages = [
            ("queues", "/".to_string()),
            ("one queue", "/queue?name=reports".to_string()),
            ("jobs, newest", "/jobs".to_string()),
            ("jobs, dead", "/jobs?state=dead".to_string()),
            ("jobs, a page deep", format!("/jobs?before={middle}")),
            (
                "jobs, rare filter",
                "/jobs?queue=sync&kind=pull&state=cancelled".to_string(),
            ),
            ("jobs, text", "/jobs?text=upstream".to_string()),
            ("one job", format!("/job?id={middle}")),
            ("leases", "/leases".to_string()),
            ("schedules", "/schedules".to_string()),
            ("workers", "/workers".to_string()),
        ];
        println!(
            "\n{backend}:\n  {:<20} {:>8} {:>8} {:>8}",
            "page", "p50", "p95", "max"
        );
        for (name, path) in &pages {
            let mut times = Vec::new();
            for i in 0..=options.samples {
                let started = Instant::now();
                let status = fetch(&base, path);
                assert_eq!(status, 200, "{path}");
                if i > 0 {
                    times.push(started.elapsed());
                }
            }
            times.sort();
            let ms = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1000.0);
            println!(
                "  {:<20} {:>8.1} {:>8.1} {:>8.1}",
                name,
                ms(percentile(&times, 0.5)),
                ms(percentile(&times, 0.95)),
                ms(times.last().copied())
            );
        }
        let _ = child.kill();
        let _ = child.wait();
        if options.keep {
            println!("  kept: {}", db.url());
            std::mem::forget(db);
        }
    }
}

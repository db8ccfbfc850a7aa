//! tenure's throughput and latency harness (no extra tooling; prints one table).
//!
//! ```text
//! cargo bench --bench throughput --all-features -- [options]
//!   --backend sqlite|postgres|mysql|all   (default: all compiled in)
//!   --jobs N          jobs per workload (default 10000)
//!   --workers N       worker threads for the drain (default 4)
//!   --payload BYTES   payload size (default 16)
//!   --runs N          runs per figure; the median is printed (default 3)
//!   --samples N       enqueue -> start samples for the latency workload (default 200)
//!   --scale           also drain with 1,000,000 finished and with 100,000 waiting jobs
//!   --prefetch N      the workers' prefetch (default: the builder's, 100)
//!   --only LIST       workloads to run, e.g. `C,D` (default: A-D; E, F, G, H, K, L, Q, R and
//!                     W only when listed)
//!   --phase-secs N    G: seconds of its clean and released phases; the snapshot is held
//!                     twice as long (default 30)
//!   --rate N          G: jobs a second (default 1000)
//!   --window-secs N   G: seconds per printed window (default 5)
//!   --autovacuum-on   G: turn PostgreSQL's autovacuum on for the run (ALTER SYSTEM, reset
//!                     after); G prints the setting it ran with
//!   --events          the drain's worker has an `on_event` hook (counting events)
//!   --metrics         a Prometheus recorder is installed (with the `metrics` feature)
//! ```
//!
//! K and L (kinds behind a backlog): 100,000 due jobs of kind B wait ahead of N jobs of the
//! kinds claimed (by priority), with no worker for B; one connection claims (10 at a time)
//! and completes until the claimed kinds are drained. K claims one kind (A), L two (A and C,
//! half of N each). p50/p95 are per `claim_kinds` call.
//!
//! Servers: `TENURE_TEST_POSTGRES_URL` / `TENURE_TEST_MYSQL_URL` (defaulting to the local
//! services); each run gets a database of its own, dropped afterwards. SQLite runs on a file
//! in a temporary directory. Everything runs with tenure's defaults (SQLite synchronous=FULL)
//! and the servers' defaults.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Pool};

mod fleet;
mod producers;
mod recovery;
mod steady;
mod support;
mod workflows;
use support::*;

struct Options {
    backends: Vec<Backend>,
    jobs: usize,
    workers: usize,
    payload: usize,
    runs: usize,
    samples: usize,
    scale: bool,
    prefetch: Option<usize>,
    only: Vec<char>,
    events: bool,
    metrics: bool,
    steady: steady::Steady,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        backends: compiled_backends(),
        jobs: 10_000,
        workers: 4,
        payload: 16,
        runs: 3,
        samples: 200,
        scale: false,
        prefetch: None,
        only: vec!['A', 'B', 'C', 'D'],
        events: false,
        metrics: false,
        steady: steady::Steady {
            phase_secs: 30,
            rate: 1000,
            window_secs: 5,
            autovacuum_on: false,
        },
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{name} needs a positive number"))
        };
        match arg.as_str() {
            "--jobs" => options.jobs = number("--jobs")?,
            "--workers" => options.workers = number("--workers")?,
            "--payload" => options.payload = number("--payload")?,
            "--runs" => options.runs = number("--runs")?,
            "--samples" => options.samples = number("--samples")?,
            "--phase-secs" => options.steady.phase_secs = number("--phase-secs")? as u64,
            "--rate" => options.steady.rate = number("--rate")? as u64,
            "--window-secs" => options.steady.window_secs = number("--window-secs")? as u64,
            "--autovacuum-on" => options.steady.autovacuum_on = true,
            "--scale" => options.scale = true,
            "--prefetch" => {
                options.prefetch = Some(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .ok_or("--prefetch needs a number")?,
                )
            }
            "--only" => {
                options.only = args
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .filter_map(|w| w.trim().chars().next())
                    .map(|c| c.to_ascii_uppercase())
                    .collect()
            }
            "--events" => options.events = true,
            "--metrics" => options.metrics = true,
            "--backend" => {
                let name = args.next().unwrap_or_default();
                options.backends = match name.as_str() {
                    "all" => compiled_backends(),
                    "sqlite" => vec![Backend::Sqlite],
                    "postgres" => vec![Backend::Postgres],
                    "mysql" | "mariadb" => vec![Backend::Mysql],
                    _ => return Err(format!("unknown backend {name:?}")),
                };
            }
            // `cargo bench` passes `--bench`; test runners (nextest) ask for a list of tests:
            // there are none.
            "--bench" => {}
            "--list" => std::process::exit(0),
            "--format" => {
                args.next();
            }
            "--ignored" => {}
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(options)
}

fn compiled_backends() -> Vec<Backend> {
    let mut backends = Vec::new();
    if cfg!(feature = "sqlite") {
        backends.push(Backend::Sqlite);
    }
    if cfg!(feature = "postgres") {
        backends.push(Backend::Postgres);
    }
    if cfg!(feature = "mysql") {
        backends.push(Backend::Mysql);
    }
    backends
}

fn batch(options: &Options, queue: &str, n: usize) -> Vec<NewJob> {
    (0..n)
        .map(|_| NewJob::new(queue, "noop", vec![b'x'; options.payload]))
        .collect()
}

/// A. One job per transaction (one statement on a bare connection), one client.
fn enqueue_one_by_one(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let job = NewJob::new("bench", "noop", vec![b'x'; options.payload]);
    let mut latencies = Vec::with_capacity(options.jobs);
    let started = Instant::now();
    for _ in 0..options.jobs {
        let t = Instant::now();
        jobs::enqueue(&mut conn, &job).expect("enqueue");
        latencies.push(t.elapsed());
    }
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        latencies,
    )
}

/// B. All jobs in one `enqueue_many` call.
fn enqueue_bulk(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let jobs = batch(options, "bench", options.jobs);
    let started = Instant::now();
    jobs::enqueue_many(&mut conn, &jobs).expect("enqueue_many");
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        vec![],
    )
}

/// B2. All jobs in one `enqueue_many` call, each with a dedup key (a retry-safe bulk
/// enqueue).
fn enqueue_bulk_keyed(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let jobs: Vec<NewJob> = batch(options, "bench", options.jobs)
        .into_iter()
        .enumerate()
        .map(|(i, job)| job.dedup_key(format!("key-{i}")))
        .collect();
    let started = Instant::now();
    jobs::enqueue_many(&mut conn, &jobs).expect("enqueue_many");
    with_latencies(
        options.jobs as f64 / started.elapsed().as_secs_f64(),
        vec![],
    )
}

/// Fills the table with `n` jobs of `queue` in bulk calls of at most 10,000.
fn fill(conn: &mut AnyConnection, options: &Options, queue: &str, n: usize) {
    let mut left = n;
    while left > 0 {
        let now = left.min(10_000);
        jobs::enqueue_many(conn, &batch(options, queue, now)).expect("fill");
        left -= now;
    }
}

/// Inserts `n` completed jobs (of another queue) as they would be after running: inserted
/// finished, not enqueued and then updated, so the setup leaves no million dead row
/// versions for the server to clean up during the drain.
fn fill_finished(conn: &mut AnyConnection, backend: Backend, n: usize) {
    let now = match backend {
        Backend::Postgres => "statement_timestamp()",
        Backend::Mysql => "UTC_TIMESTAMP(6)",
        _ => "strftime('%Y-%m-%d %H:%M:%f','now')",
    };
    let row = format!("('old', 'noop', 'x', 0, 'completed', 1, 25, {now}, {now}, {now})");
    let mut left = n;
    while left > 0 {
        let rows = left.min(1000);
        let values = vec![row.as_str(); rows].join(", ");
        conn.batch_execute(&format!(
            "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, \
             max_attempts, due_at, created_at, finished_at) VALUES {values}"
        ))
        .expect("insert finished jobs");
        left -= rows;
    }
}

/// C. Drain `options.jobs` waiting jobs with a worker of `options.workers` threads; before
/// that, `setup` may fill the table. Also samples the process's resident memory.
fn drain(backend: Backend, options: &Options, setup: Setup) -> (Figures, u64) {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let to_drain = options.jobs;
    match setup {
        Setup::Empty => {}
        Setup::Finished(n) => fill_finished(&mut conn, backend, n),
        Setup::Waiting(n) => fill(&mut conn, options, "bench", n),
        Setup::RateLimited(..) | Setup::Workflow(_) => {}
    }
    let mut to_drain = to_drain;
    if let Setup::Workflow(callbacks) = setup {
        // N parts, then one merge waiting for all of them (W1), or three batch callbacks
        // (W2): every completion counts down the waiting jobs' stripes.
        let mut flow = jobs::Workflow::new("bench");
        let parts: Vec<_> = batch(options, "bench", to_drain)
            .into_iter()
            .map(|job| flow.add(job))
            .collect();
        let merge = NewJob::new("bench", "noop", vec![]);
        if callbacks {
            flow.on_success(merge.clone())
                .on_failure(merge.clone())
                .on_finish(merge);
            to_drain += 2;
        } else {
            flow.add_after(&parts, merge);
            to_drain += 1;
        }
        jobs::enqueue_workflow(&mut conn, &flow).expect("fill");
    } else if let Setup::RateLimited(max, per) = setup {
        for chunk in batch(options, "bench", to_drain).chunks(10_000) {
            let limited: Vec<NewJob> = chunk
                .iter()
                .map(|job| job.clone().rate_limit("bench", max, per))
                .collect();
            jobs::enqueue_many(&mut conn, &limited).expect("fill");
        }
    } else {
        fill(&mut conn, options, "bench", to_drain);
    }
    if !matches!(
        setup,
        Setup::Empty | Setup::RateLimited(..) | Setup::Workflow(_)
    ) {
        settle(backend, &mut conn);
    }
    let done = Arc::new(AtomicUsize::new(0));
    let pool = db.pool(options.workers as u32 + 4);
    let counter = done.clone();
    let events = Arc::new(AtomicUsize::new(0));
    let mut builder = bench_worker(pool, options).raw_handler(
        "noop",
        move |_ctx: &JobContext, _payload: &[u8]| {
            counter.fetch_add(1, Ordering::Relaxed);
            Ok::<(), JobError>(())
        },
    );
    if options.events {
        let events = events.clone();
        builder = builder.on_event(move |_| {
            events.fetch_add(1, Ordering::Relaxed);
        });
    }
    let started = Instant::now();
    let worker = builder.start().expect("start the worker");
    let mut rss = 0;
    while worker.report().completed < to_drain {
        rss = rss.max(resident_bytes("VmRSS"));
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = started.elapsed();
    worker.shutdown(Duration::from_secs(10));
    if options.events {
        assert!(
            events.load(Ordering::Relaxed) >= to_drain,
            "an event per run"
        );
    }
    let jobs_per_s = to_drain as f64 / took.as_secs_f64();
    (with_latencies(jobs_per_s, vec![]), rss)
}

/// After a bulk setup, lets the server catch up as it would have while those jobs piled up
/// over days: PostgreSQL's autovacuum (run now); InnoDB's purge of the old
/// row versions the setup's UPDATE left (waited for) and the writing of the pages it dirtied.
/// Otherwise the drain would measure the cleanup of the setup.
fn settle(backend: Backend, conn: &mut AnyConnection) {
    #[derive(diesel::QueryableByName)]
    struct Figure {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    use diesel::RunQueryDsl;
    let figure = |conn: &mut AnyConnection, sql: &str| {
        diesel::sql_query(sql)
            .get_result::<Figure>(conn)
            .map_or(0, |f| f.n)
    };
    match backend {
        // No CHECKPOINT: right after one, every page's first change writes a full page
        // image to the WAL, and the drain would pay for that instead.
        Backend::Postgres => conn
            .batch_execute("VACUUM ANALYZE tenure_jobs")
            .expect("vacuum"),
        Backend::Mysql => {
            conn.batch_execute("ANALYZE TABLE tenure_jobs")
                .expect("analyze");
            // The history list counts transactions, not rows: the setup's one big UPDATE is
            // one entry until its million row versions are purged.
            let until = Instant::now() + Duration::from_secs(120);
            while Instant::now() < until {
                let history = figure(
                    conn,
                    "SELECT CAST(`COUNT` AS SIGNED) AS n FROM information_schema.INNODB_METRICS \
                     WHERE NAME = 'trx_rseg_history_len'",
                );
                if history == 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            // Then write the pages the setup dirtied (what FOR EXPORT is for), instead of
            // during the drain.
            conn.batch_execute("FLUSH TABLES tenure_jobs FOR EXPORT")
                .expect("flush the table");
            conn.batch_execute("UNLOCK TABLES").expect("unlock");
        }
        _ => {}
    }
}

/// A worker on the bench queue with the harness's threads and prefetch.
fn bench_worker(pool: Pool, options: &Options) -> tenure::worker::WorkerBuilder {
    let builder = Worker::builder(pool)
        .queue("bench")
        .threads(options.workers);
    match options.prefetch {
        Some(prefetch) => builder.prefetch(prefetch),
        None => builder,
    }
}

#[derive(Clone, Copy)]
enum Setup {
    Empty,
    Finished(usize),
    Waiting(usize),
    /// Every job to drain carries this rate limit on one key, `(max, per)`: with 10,000 per
    /// millisecond it never throttles (what the rate bookkeeping costs a claim); with a
    /// lower rate, how close the worker comes to it.
    RateLimited(u32, Duration),
    /// The jobs are one workflow's parts: with one job waiting for all of them (false), or a
    /// batch with three callbacks (true).
    Workflow(bool),
}

/// D. Enqueue -> handler start on an idle worker, one job at a time.
fn latency(backend: Backend, options: &Options) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let pool = db.pool(options.workers as u32 + 4);
    let enqueued_at: Arc<Mutex<BTreeMap<i64, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let (seen, sink) = (enqueued_at.clone(), latencies.clone());
    let worker = bench_worker(pool, options)
        .raw_handler("noop", move |ctx: &JobContext, _payload: &[u8]| {
            let now = Instant::now();
            // The enqueuer records the instant before the insert; wait for it if the job
            // started before the enqueuer got its id back.
            loop {
                let at = seen.lock().expect("lock").get(&ctx.id).copied();
                if let Some(at) = at {
                    sink.lock().expect("lock").push(now - at);
                    return Ok::<(), JobError>(());
                }
                std::thread::yield_now();
            }
        })
        .start()
        .expect("start the worker");
    // Let the worker go idle first.
    std::thread::sleep(Duration::from_millis(300));
    let job = NewJob::new("bench", "noop", vec![b'x'; options.payload]);
    for _ in 0..options.samples {
        let before = Instant::now();
        let id = jobs::enqueue(&mut conn, &job).expect("enqueue").id;
        enqueued_at.lock().expect("lock").insert(id, before);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let started = latencies.lock().expect("lock").len();
            if started == enqueued_at.lock().expect("lock").len() {
                break;
            }
            assert!(Instant::now() < deadline, "a job did not start within 10 s");
            std::thread::sleep(Duration::from_micros(200));
        }
        // Idle again between samples, as a real idle worker would be.
        std::thread::sleep(Duration::from_millis(20));
    }
    // What an idle worker costs: CPU time of this process over 2 s with nothing to do.
    let (cpu_before, wall) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let idle = (cpu_seconds() - cpu_before) / wall.elapsed().as_secs_f64();
    IDLE_CPU.lock().expect("lock").push((backend, idle));
    worker.shutdown(Duration::from_secs(10));
    let latencies = latencies.lock().expect("lock").clone();
    with_latencies(0.0, latencies)
}

/// K / L. Claims of `kinds` (N jobs, spread over them) behind 100,000 due jobs of kind B
/// ahead of them by priority, on one connection, 10 per claim, each batch completed.
fn kinds_backlog(backend: Backend, options: &Options, kinds: &[&str]) -> Figures {
    const BACKLOG: usize = 100_000;
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let mut left = BACKLOG;
    while left > 0 {
        let now = left.min(10_000);
        let backlog: Vec<NewJob> = (0..now)
            .map(|_| NewJob::new("bench", "B", vec![b'x'; options.payload]).priority(-1))
            .collect();
        jobs::enqueue_many(&mut conn, &backlog).expect("fill the backlog");
        left -= now;
    }
    let wanted: Vec<NewJob> = (0..options.jobs)
        .map(|i| NewJob::new("bench", kinds[i % kinds.len()], vec![b'x'; options.payload]))
        .collect();
    for chunk in wanted.chunks(10_000) {
        jobs::enqueue_many(&mut conn, chunk).expect("fill");
    }
    settle(backend, &mut conn);
    let ttl = Duration::from_secs(60);
    let mut latencies = Vec::new();
    let (mut done, started) = (0, Instant::now());
    while done < options.jobs {
        let t = Instant::now();
        let claimed = jobs::claim_kinds(&mut conn, "bench", kinds, 10, ttl).expect("claim");
        latencies.push(t.elapsed());
        assert!(!claimed.is_empty(), "the claimed kinds ran out early");
        assert!(claimed.iter().all(|j| j.kind != "B"), "a B job was claimed");
        let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
        jobs::complete(&mut conn, &claims).expect("complete");
        done += claimed.len();
    }
    with_latencies(done as f64 / started.elapsed().as_secs_f64(), latencies)
}

/// Idle worker CPU use (fraction of one core) per latency run.
static IDLE_CPU: Mutex<Vec<(Backend, f64)>> = Mutex::new(Vec::new());

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("--fleet-child") {
        fleet::child(args);
    }
    recovery::run_victim_if_asked();
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("throughput: {message}");
            std::process::exit(2);
        }
    };
    println!(
        "tenure throughput: {} jobs, {} worker threads, {}-byte payloads, prefetch {}, median of {} runs",
        options.jobs,
        options.workers,
        options.payload,
        options.prefetch.map_or("default".into(), |p| p.to_string()),
        options.runs
    );
    if options.metrics {
        install_metrics();
    }
    println!(
        "event hook: {}; metrics recorder: {}",
        if options.events { "on" } else { "off" },
        if options.metrics {
            "Prometheus"
        } else {
            "none"
        }
    );
    println!("machine: {}", machine());
    println!();
    println!("| backend | workload | jobs/s | p50 | p95 | RSS while draining |");
    println!("|---|---|---|---|---|---|");
    for &backend in &options.backends {
        let name = format!("{backend:?}");
        let row = |workload: &str, figures: Figures, rss: Option<u64>| {
            let rate = if figures.jobs_per_s > 0.0 {
                format!("{:.0}", figures.jobs_per_s)
            } else {
                "-".into()
            };
            let rss = rss.map_or("-".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
            println!(
                "| {name} | {workload} | {rate} | {} | {} | {rss} |",
                ms(figures.p50),
                ms(figures.p95)
            );
        };
        let runs = |f: &dyn Fn() -> Figures| median((0..options.runs).map(|_| f()).collect());
        let wanted = |w: char| options.only.contains(&w);
        if wanted('A') {
            row(
                "A. enqueue, one per transaction",
                runs(&|| enqueue_one_by_one(backend, &options)),
                None,
            );
        }
        if wanted('B') {
            row(
                "B. enqueue, one bulk call",
                runs(&|| enqueue_bulk(backend, &options)),
                None,
            );
            row(
                "B2. enqueue, one bulk call, every job keyed",
                runs(&|| enqueue_bulk_keyed(backend, &options)),
                None,
            );
        }
        let drain_row = |label: &str, setup: Setup| {
            let results: Vec<(Figures, u64)> = (0..options.runs)
                .map(|_| drain(backend, &options, setup))
                .collect();
            let rss = results.iter().map(|r| r.1).max();
            row(
                label,
                median(results.into_iter().map(|r| r.0).collect()),
                rss,
            );
        };
        if wanted('C') {
            drain_row(
                &format!("C. drain, {} threads", options.workers),
                Setup::Empty,
            );
        }
        if wanted('R') {
            drain_row(
                &format!(
                    "R. drain, {} threads, every job rate-limited",
                    options.workers
                ),
                Setup::RateLimited(10_000, Duration::from_millis(1)),
            );
            drain_row(
                "R2. drain under a rate limit of 1,000 a second",
                Setup::RateLimited(1000, Duration::from_secs(1)),
            );
        }
        if wanted('W') {
            drain_row(
                &format!("W1. drain, one job waits for all {}", options.jobs),
                Setup::Workflow(false),
            );
            drain_row(
                "W2. drain, a batch of them with 3 callbacks",
                Setup::Workflow(true),
            );
            row(
                &format!(
                    "W3. one job waits for all {}, {} claimers, one completion a transaction",
                    options.jobs,
                    workflows::CLAIMERS
                ),
                runs(&|| workflows::fan_in_by_claimers(backend, options.jobs)),
                None,
            );
        }
        if wanted('E') {
            for threads in producers::PRODUCERS {
                let mut ratio = Vec::new();
                for (how, label) in [
                    (
                        producers::Producer::PlainInsert,
                        "plain diesel insert (ceiling)",
                    ),
                    (producers::Producer::Tenure, "tenure enqueue"),
                ] {
                    let figures =
                        runs(&|| producers::producers(backend, options.jobs, threads, how));
                    ratio.push(figures.jobs_per_s);
                    row(
                        &format!("E. {threads} producers, one job a transaction: {label}"),
                        figures,
                        None,
                    );
                }
                println!(
                    "| {name} | E. {threads} producers: tenure / ceiling | {:.2} | | | |",
                    ratio[1] / ratio[0]
                );
            }
        }
        if wanted('F') {
            for (processes, threads) in fleet::SHAPES {
                row(
                    &format!("F. drain, {processes} worker processes x {threads} threads"),
                    runs(&|| fleet::fleet(backend, options.jobs, processes, threads)),
                    None,
                );
            }
        }
        if wanted('Q') {
            let (depth, stats) = steady::depth_calls(backend);
            row(
                "Q. queue_depth (bound 10,000), 1,000,000 waiting",
                depth,
                None,
            );
            row("Q. stats, 1,000,000 waiting", stats, None);
        }
        if wanted('D') {
            row(
                "D. enqueue -> start, idle worker",
                runs(&|| latency(backend, &options)),
                None,
            );
        }
        if wanted('H') {
            let label = "H. crash recovery: a killed worker's jobs start again (after the kill)";
            row(label, runs(&|| recovery::crash_recovery(backend)), None);
        }
        if wanted('K') {
            row(
                "K. claim 1 kind behind 100,000 others",
                runs(&|| kinds_backlog(backend, &options, &["A"])),
                None,
            );
        }
        if wanted('L') {
            row(
                "L. claim 2 kinds behind 100,000 others",
                runs(&|| kinds_backlog(backend, &options, &["A", "C"])),
                None,
            );
        }
        if options.scale {
            drain_row(
                "C1. drain, 1,000,000 finished in the table",
                Setup::Finished(1_000_000),
            );
            drain_row("C2. drain, 100,000 more waiting", Setup::Waiting(100_000));
        }
    }
    if options.only.contains(&'G') {
        for &backend in &options.backends {
            steady::steady(backend, &options.steady);
        }
    }
    println!();
    for (backend, idle) in IDLE_CPU.lock().expect("lock").iter() {
        println!(
            "idle {}-thread worker on {backend:?}: {:.1}% of a core",
            options.workers,
            idle * 100.0
        );
    }
    recovery::print_summary();
    println!(
        "peak RSS of the process: {:.1} MiB",
        resident_bytes("VmHWM") as f64 / 1048576.0
    );
}

/// `--metrics`: a Prometheus recorder, so the workers' counters and histograms are real.
#[cfg(feature = "metrics")]
fn install_metrics() {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("install the Prometheus recorder");
}

#[cfg(not(feature = "metrics"))]
fn install_metrics() {
    eprintln!("throughput: --metrics needs the `metrics` feature");
    std::process::exit(2);
}

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
//!   --only LIST       workloads to run, e.g. `C,D` (default: A-D; E, F, G, H, K, L, P, Q, R,
//!                     S, V, W, X, Y and Z only when listed)
//!   --phase-secs N    G: seconds of its clean and released phases; the snapshot is held
//!                     twice as long unless --hold-secs says (default 30)
//!   --hold-secs N     G: seconds the snapshot is held (the issue's ten minutes: 600)
//!   --rate N          G: jobs a second (default 1000)
//!   --window-secs N   G and P: seconds per printed window (default 5)
//!   --capacity-secs N P: seconds of the run at capacity (default 300)
//!   --events          the drain's worker has an `on_event` hook (counting events)
//!   --metrics         a Prometheus recorder is installed (with the `metrics` feature)
//! ```
//!
//! K and L (kinds behind a backlog): 100,000 due jobs of kind B wait ahead of N jobs of the
//! kinds claimed (by priority), with no worker for B; one connection claims (10 at a time)
//! and completes until the claimed kinds are drained. K claims one kind (A), L two (A and C,
//! half of N each). p50/p95 are per `claim_kinds` call.
//!
//! G and P also write their windows as SVG charts (pickup p99, dead versions, size; P's rate)
//! to `TENURE_BENCH_CHARTS` (default `bench-charts/`), one file per backend and length.
//!
//! Servers: `TENURE_TEST_POSTGRES_URL` / `TENURE_TEST_MYSQL_URL` (defaulting to the local
//! services); each run gets a database of its own, dropped afterwards. G and P print the
//! server's `autovacuum` setting; to measure with it on (this machine's server has it off),
//! point `TENURE_TEST_POSTGRES_URL` at a private server: `TENURE_PRIVATE_PG_SETTINGS="-c
//! fsync=on -c autovacuum=on" scripts/private-servers start-postgres DIR` prints its URL. The
//! harness never changes a server's settings. SQLite runs on a file
//! in a temporary directory. Everything runs with tenure's defaults (SQLite synchronous=FULL)
//! and the servers' defaults.

use std::time::Duration;

mod aging;
mod capacity;
mod chart;
mod drain;
mod enqueue;
mod fairness;
mod fleet;
mod kinds;
mod latency;
mod leases;
mod options;
mod producers;
mod recovery;
mod steady;
mod support;
mod waiting;
mod workflows;
use drain::{Setup, drain};
use enqueue::{enqueue_bulk, enqueue_bulk_keyed, enqueue_one_by_one, enqueue_sequenced};
use kinds::kinds_backlog;
use latency::{IDLE_CPU, latency};
use options::parse_options;
use support::*;

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
        if wanted('S') {
            let label = "S1. lease hand-off, released in this process (release -> grant)";
            row(label, leases::handoff(backend, &options, false), None);
            let label = "S2. lease hand-off, released by another session";
            row(label, leases::handoff(backend, &options, true), None);
            let label = "S4. lease hand-off beside 4 threads polling try_take";
            row(
                label,
                leases::handoff_among_pollers(backend, &options),
                None,
            );
            let label = "S3. lease try_take + release, one caller (per take)";
            row(
                label,
                runs(&|| leases::take_release(backend, &options)),
                None,
            );
            let label = "S5. LeaseGuard::take_pooled_as + release, fast takeover (per take)";
            row(
                label,
                runs(&|| leases::guard_take_release(backend, &options, true)),
                None,
            );
            let label = "S5. the same with fast_takeover(false)";
            row(
                label,
                runs(&|| leases::guard_take_release(backend, &options, false)),
                None,
            );
        }
        if wanted('Z') {
            row(
                "Z1. enqueue, one per transaction, on 100 sequence keys",
                runs(&|| enqueue_sequenced(backend, &options, 100)),
                None,
            );
            drain_row(
                &format!("Z2. drain, {} threads, 100 sequence keys", options.workers),
                Setup::Sequenced(100),
            );
        }
        if wanted('X') {
            for fair in [true, false] {
                let (figures, longest, ahead) = fairness::late_tenants(backend, &options, fair);
                let label = if fair {
                    format!(
                        "X1. 90 jobs of 9 tenants behind one tenant's 50,000, fair: wait (longest {}; {ahead} of the 50,000 started first)",
                        ms(Some(longest))
                    )
                } else {
                    format!(
                        "X1. the same without fair keys (control): wait (longest {}; {ahead} started first)",
                        ms(Some(longest))
                    )
                };
                row(&label, figures, None);
            }
            drain_row(
                &format!(
                    "X2. drain, {} threads, one tenant (fair key)",
                    options.workers
                ),
                Setup::Fair(1),
            );
            drain_row(
                &format!("X2. drain, {} threads, 100 tenants", options.workers),
                Setup::Fair(100),
            );
            drain_row(
                &format!(
                    "X2. drain, {} threads, no fair keys (as C)",
                    options.workers
                ),
                Setup::Empty,
            );
        }
        if wanted('Y') {
            for after in [
                Some(Duration::from_secs(1)),
                Some(Duration::from_secs(5)),
                None,
            ] {
                let (figures, longest, ran) = aging::aging(backend, &options, after);
                let label = match after {
                    Some(after) => format!(
                        "Y. low job behind an urgent stream, aged after {after:?}: wait (longest {}, {ran} of 20 ran)",
                        ms(Some(longest))
                    ),
                    None => {
                        format!("Y. the same without aging (control): {ran} of 20 ran within 10 s")
                    }
                };
                row(&label, figures, None);
            }
        }
        if wanted('V') {
            waiting::waiting(backend, &options);
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
    if options.only.contains(&'P') {
        for &backend in &options.backends {
            capacity::capacity(
                backend,
                options.capacity_secs,
                options.steady.window_secs,
                options.workers,
            );
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

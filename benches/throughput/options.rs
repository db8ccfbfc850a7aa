//! The harness's command line (see `main.rs` for the options) and the backends compiled in.

use tenure::Backend;

use crate::steady;

pub struct Options {
    pub backends: Vec<Backend>,
    pub jobs: usize,
    pub workers: usize,
    pub payload: usize,
    pub runs: usize,
    pub samples: usize,
    pub scale: bool,
    pub prefetch: Option<usize>,
    pub only: Vec<char>,
    pub events: bool,
    pub metrics: bool,
    pub steady: steady::Steady,
    /// P: seconds of the run at capacity.
    pub capacity_secs: u64,
}

pub fn parse_options() -> Result<Options, String> {
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
            hold_secs: None,
            rate: 1000,
            window_secs: 5,
        },
        capacity_secs: 300,
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
            "--hold-secs" => options.steady.hold_secs = Some(number("--hold-secs")? as u64),
            "--rate" => options.steady.rate = number("--rate")? as u64,
            "--window-secs" => options.steady.window_secs = number("--window-secs")? as u64,
            "--capacity-secs" => options.capacity_secs = number("--capacity-secs")? as u64,
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

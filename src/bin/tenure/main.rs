//! `tenure`: see and steer tenure's tables, run shell-command jobs, and watch a demo.

mod children;
mod database;
mod demo;
mod duration;
mod enqueue;
mod job_commands;
mod job_links;
mod lease_commands;
mod lease_run;
mod lease_signals;
mod output;
mod park_commands;
mod queue_commands;
mod schedule_commands;
mod serve;
mod stats;
mod watchdog;
mod work;
mod workflow_commands;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde_json::json;
use tenure::Error;

use lease_commands::LeasesCommand;
use output::Out;

const EXIT_CODES: &str = "\
Exit codes: 0 done; 1 the operation failed (database error, or nothing to act on: no such
job, lease, schedule or workflow); 2 bad arguments or input; 3 cannot connect to the database
(or open its SQLite file); 4 the database has no tenure tables yet, or its SQLite file does not
exist (run `tenure migrate`). A reader that goes away (`tenure jobs list | head`) is not an error: tenure
stops writing and exits with the status of what it did. `tenure lease run` has its own table
(see `tenure lease run --help`): the command's status, 75 held, 76 lease lost. `tenure enqueue
--wait`: 5 the job ended dead, 6 cancelled, 7 not ended within --timeout. `tenure jobs
complete-parked`, `fail-parked`, `resume-parked`: 8 the token was refused (wrong, used, or its
job no longer parked).";

/// Leases and a job queue in your database: inspect and steer them.
#[derive(Parser)]
#[command(name = "tenure", version, after_help = EXIT_CODES)]
struct Cli {
    /// Database URL (postgres://, mysql://, sqlite:// or a file path). Defaults to
    /// TENURE_DATABASE_URL, then DATABASE_URL, then the SQLite file tenure.db here; `demo`
    /// alone ignores both variables and uses tenure-demo.db unless this flag is given.
    #[arg(long, global = true)]
    database_url: Option<String>,
    /// Print JSON instead of tables (read commands).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update tenure's tables, and say the schema version. Backends take different
    /// numbers of steps to the same version (MySQL/MariaDB one more, as its DDL cannot share
    /// a transaction), so compare versions, not counts.
    Migrate,
    /// Jobs per queue and state, the oldest waiting job's age, running jobs and their lease
    /// deadlines.
    Stats,
    /// List, show, retry, cancel and prune jobs.
    #[command(subcommand)]
    Jobs(job_commands::JobsCommand),
    /// Show workflows and batches as trees of their jobs, list them, cancel them.
    #[command(subcommand)]
    Workflows(workflow_commands::WorkflowsCommand),
    /// List and release leases, and run a command while holding one (`tenure lease run`).
    #[command(subcommand, alias = "lease")]
    Leases(LeasesCommand),
    /// Pause and resume queues.
    #[command(subcommand, alias = "queue")]
    Queues(queue_commands::QueuesCommand),
    /// List, add, pause, resume and remove recurring schedules.
    #[command(subcommand)]
    Schedules(schedule_commands::SchedulesCommand),
    /// Enqueue a job: a `shell` job (--command) for `tenure work`, or a job of your program's
    /// (--kind, --payload JSON).
    Enqueue(enqueue::EnqueueArgs),
    /// Run shell-command jobs: whoever can enqueue on those queues can run commands here
    /// (see `tenure work --help`).
    #[command(after_help = work::ABOUT)]
    Work(work::WorkArgs),
    /// Serve a dashboard (queues, jobs, leases, schedules, workers, with actions) in the
    /// browser: on 127.0.0.1:8080 unless told otherwise (see `tenure serve --help`).
    #[command(after_help = serve::ABOUT)]
    Serve(serve::ServeArgs),
    /// Enqueue a realistic batch and run it with a live progress bar. Its database is the
    /// SQLite file tenure-demo.db here, made anew each time, unless --database-url is given
    /// (TENURE_DATABASE_URL and DATABASE_URL are ignored, so that a demo never writes into the
    /// database your environment points at).
    Demo(demo::DemoArgs),
    /// The watchdog of a command `work` or `lease run` starts (watchdog.rs): tenure runs it
    /// itself, people do not.
    #[command(name = "__watchdog", hide = true)]
    Watchdog { grace_ms: u64 },
}

/// A failure with its exit code.
pub struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// The same failure, its message led by `what` (a flag's name).
    pub fn prefixed(self, what: &str) -> Self {
        Failure::new(self.code, format!("{what}: {}", self.message))
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let code = match &error {
            Error::Connect { .. } => 3,
            Error::ParkTokenRefused(_) => 8,
            e if e.is_invalid_input() => 2,
            Error::UnsupportedUrl { .. } | Error::BackendNotEnabled { .. } => 2,
            _ => 1,
        };
        Failure::new(code, error.to_string())
    }
}

type Outcome = Result<(), Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let out = Out { json: cli.json };
    match run(cli, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            // `tenure lease run` passes its command's status on without a message.
            if !failure.message.is_empty() {
                // A closed stderr (a log reader gone) must not turn the status into a panic.
                // Messages may quote stored text: escaped like the rest of the output.
                let message = output::clean_lines(&failure.message);
                let _ = writeln!(std::io::stderr(), "tenure: {message}");
            }
            ExitCode::from(failure.code)
        }
    }
}

fn run(cli: Cli, out: &Out) -> Outcome {
    if let Command::Watchdog { grace_ms } = cli.command {
        return match watchdog::serve(grace_ms) {
            0 => Ok(()),
            code => Err(Failure::new(code, String::new())),
        };
    }
    if let Command::Demo(args) = cli.command {
        return demo::run(args, cli.database_url);
    }
    let target = database::target(cli.database_url.as_deref());
    database::check_url(&target.url)?;
    // Each command checks its arguments before it opens the database (`open` refuses an
    // SQLite file that does not exist rather than create it, but for `migrate`).
    let open = || database::open(&target, 2, true);
    match cli.command {
        Command::Migrate => migrate(&target, out),
        Command::Stats => stats::stats(&open()?, out),
        Command::Jobs(command) => job_commands::run(open, command, out),
        Command::Workflows(command) => workflow_commands::run(open, command, out),
        Command::Leases(LeasesCommand::Run(args)) => lease_run::run(&target, args),
        Command::Leases(command) => lease_commands::run(&open()?, command, out),
        Command::Queues(command) => queue_commands::run(open, command, out),
        Command::Schedules(command) => schedule_commands::run(open, command, out),
        Command::Enqueue(args) => enqueue::enqueue(open, args, out),
        Command::Work(args) => work::run(&target, args),
        Command::Serve(args) => serve::run(&target, args),
        Command::Demo(_) | Command::Watchdog { .. } => {
            Err(Failure::new(1, "a command reached the wrong place"))
        }
    }
}

/// `tenure migrate`: the schema version reached, and how many steps this run applied.
fn migrate(target: &database::Target, out: &Out) -> Outcome {
    let pool = database::open(target, 1, false)?;
    let applied = tenure::run_migrations(&mut pool.get()?)?;
    let version = tenure::schema_version(&mut pool.get()?)?.unwrap_or_default();
    out.print(
        json!({"version": version, "applied": applied, "backend": pool.backend().to_string()}),
        || {
            let done = match applied.len() {
                0 => "already up to date".to_string(),
                n => format!("applied {n} migration step(s) on {}", pool.backend()),
            };
            format!("schema at version {version}; {done}")
        },
    )
}

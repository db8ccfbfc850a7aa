//! `dibs`: see and steer dibs's tables, run shell-command jobs, and watch a demo.

mod demo;
mod lease_run;
mod output;
mod work;

use std::process::ExitCode;
use std::time::Duration;

use std::io::Write;

use clap::{Args, Parser, Subcommand};
use dibs::jobs::{self, Finished, JobFilter, JobState, NewJob, Retention};
use dibs::schedules::{self, Schedule};
use dibs::{Error, Pool};
use serde_json::json;

use output::{Out, age, table};

const EXIT_CODES: &str = "\
Exit codes: 0 done; 1 the operation failed (database error, or nothing to act on: no such
job, lease or schedule); 2 bad arguments or input; 3 cannot connect to the database; 4 the
database has no dibs tables yet (run `dibs migrate`). `dibs lease run` has its own table
(see `dibs lease run --help`): the command's status, 75 held, 76 lease lost.";

/// Leases and a job queue in your database: inspect and steer them.
#[derive(Parser)]
#[command(name = "dibs", version, after_help = EXIT_CODES)]
struct Cli {
    /// Database URL (postgres://, mysql://, sqlite:// or a file path). Defaults to
    /// DIBS_DATABASE_URL, then DATABASE_URL, then the SQLite file dibs.db here.
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
    /// Create or update dibs's tables.
    Migrate,
    /// Jobs per queue and state, the oldest waiting job's age, running jobs and their lease
    /// deadlines.
    Stats,
    /// List, show, retry, cancel and prune jobs.
    #[command(subcommand)]
    Jobs(JobsCommand),
    /// List and release leases, and run a command while holding one (`dibs lease run`).
    #[command(subcommand, alias = "lease")]
    Leases(LeasesCommand),
    /// List, add, pause, resume and remove recurring schedules.
    #[command(subcommand)]
    Schedules(SchedulesCommand),
    /// Enqueue a job.
    Enqueue(EnqueueArgs),
    /// Run shell-command jobs: whoever can enqueue on those queues can run commands here
    /// (see `dibs work --help`).
    #[command(after_help = work::ABOUT)]
    Work(work::WorkArgs),
    /// Enqueue a realistic batch and run it with a live progress bar (SQLite file
    /// dibs-demo.db unless a URL is given).
    Demo(demo::DemoArgs),
}

#[derive(Subcommand)]
enum JobsCommand {
    /// Jobs, newest first.
    List {
        #[arg(long)]
        queue: Option<String>,
        /// waiting, running, completed, dead or cancelled.
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        kind: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// One job, its error history and its recorded outputs.
    Show { id: i64 },
    /// Run a dead job again from its first attempt.
    Retry { id: i64 },
    /// Cancel a waiting or running job.
    Cancel { id: i64 },
    /// Delete finished jobs of a queue.
    Prune {
        #[arg(long)]
        queue: String,
        /// completed, dead or cancelled.
        #[arg(long, default_value = "completed")]
        state: String,
        /// Keep the newest N.
        #[arg(long, conflicts_with = "older_than")]
        keep: Option<u64>,
        /// Delete those finished longer ago than this (e.g. 7d, 12h, 30m).
        #[arg(long)]
        older_than: Option<String>,
    },
}

#[derive(Subcommand)]
enum LeasesCommand {
    /// Every lease: holder, fence, expiry.
    List,
    /// Release a lease whoever holds it. Its holder is not told: use only for a holder you
    /// know is gone.
    Release {
        name: String,
        /// Confirm that the holder is gone.
        #[arg(long)]
        force: bool,
    },
    /// Run a command while holding the lease NAME, so runs of it never overlap (cron jobs):
    /// `dibs lease run NAME [--ttl 30s] [--wait 10m | --no-wait] -- COMMAND [ARGS...]`.
    #[command(after_help = lease_run::ABOUT)]
    Run(lease_run::RunArgs),
}

#[derive(Subcommand)]
enum SchedulesCommand {
    /// Every schedule and its next tick.
    List,
    /// Add (or replace) a schedule.
    Add {
        name: String,
        /// A cron expression (5 fields, or 6 with seconds).
        #[arg(long, conflicts_with = "every", required_unless_present = "every")]
        cron: Option<String>,
        /// A fixed interval (e.g. 30s, 5m, 1h).
        #[arg(long)]
        every: Option<String>,
        /// IANA time zone of the cron expression.
        #[arg(long, default_value = "UTC")]
        time_zone: String,
        #[command(flatten)]
        job: JobArgs,
    },
    /// Pause a schedule.
    Pause { name: String },
    /// Resume a paused schedule.
    Resume { name: String },
    /// Remove a schedule.
    Remove { name: String },
}

#[derive(Args)]
struct JobArgs {
    #[arg(long)]
    queue: String,
    /// The job's kind (`shell` for `dibs work`).
    #[arg(long, default_value = "shell")]
    kind: String,
    /// For `shell` jobs: the command line (run by /bin/sh -c).
    #[arg(long, conflicts_with = "payload")]
    command: Option<String>,
    /// For `shell` jobs: an environment variable of the command, NAME=VALUE (repeatable).
    #[arg(long = "env", requires = "command")]
    env: Vec<String>,
    /// The payload as given (text; JSON for typed handlers).
    #[arg(long)]
    payload: Option<String>,
    #[arg(long, default_value_t = 0)]
    priority: i32,
    #[arg(long, default_value_t = 25)]
    max_attempts: u32,
}

#[derive(Args)]
struct EnqueueArgs {
    #[command(flatten)]
    job: JobArgs,
    /// Run it after this long (e.g. 10s, 5m).
    #[arg(long)]
    delay: Option<String>,
    /// Do not enqueue if a live job of the queue has this key.
    #[arg(long)]
    dedup_key: Option<String>,
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
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let code = match &error {
            Error::Connect { .. } => 3,
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
            // `dibs lease run` passes its command's status on without a message.
            if !failure.message.is_empty() {
                // A closed stderr (a log reader gone) must not turn the status into a panic.
                let _ = writeln!(std::io::stderr(), "dibs: {}", failure.message);
            }
            ExitCode::from(failure.code)
        }
    }
}

fn database_url(cli: &Cli) -> String {
    cli.database_url
        .clone()
        .or_else(|| std::env::var("DIBS_DATABASE_URL").ok())
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| "dibs.db".to_string())
}

/// Opens the pool; every command but `migrate` and `demo` needs dibs's tables.
fn open(url: &str, max_size: u32, need_tables: bool) -> Result<Pool, Failure> {
    let pool = Pool::options().max_size(max_size).open(url)?;
    if need_tables && dibs::schema_version(&mut pool.get()?)?.is_none() {
        return Err(Failure::new(
            4,
            "the database has no dibs tables yet: run `dibs migrate` first",
        ));
    }
    Ok(pool)
}

fn run(cli: Cli, out: &Out) -> Outcome {
    let url = database_url(&cli);
    match cli.command {
        Command::Migrate => {
            let pool = open(&url, 1, false)?;
            let applied = dibs::run_migrations(&mut pool.get()?)?;
            let version = dibs::schema_version(&mut pool.get()?)?;
            out.print(json!({"applied": applied, "version": version}), || {
                format!(
                    "applied {} migration(s); schema {}",
                    applied.len(),
                    version.unwrap_or_default()
                )
            });
            Ok(())
        }
        Command::Stats => stats(&open(&url, 2, true)?, out),
        Command::Jobs(command) => jobs_command(&open(&url, 2, true)?, command, out),
        Command::Leases(LeasesCommand::Run(args)) => lease_run::run(&url, args),
        Command::Leases(command) => leases_command(&open(&url, 2, true)?, command, out),
        Command::Schedules(command) => schedules_command(&open(&url, 2, true)?, command, out),
        Command::Enqueue(args) => enqueue(&open(&url, 2, true)?, args, out),
        Command::Work(args) => work::run(&url, args),
        Command::Demo(args) => demo::run(args, cli.database_url.is_some().then_some(url)),
    }
}

fn stats(pool: &Pool, out: &Out) -> Outcome {
    let stats = jobs::stats(&mut pool.get()?)?;
    let queues: Vec<_> = stats
        .queues
        .iter()
        .map(|q| {
            json!({"queue": q.queue, "waiting": q.waiting, "running": q.running,
                   "completed": q.completed, "dead": q.dead, "cancelled": q.cancelled,
                   "paused": q.paused, "oldest_waiting_seconds": q.oldest_waiting.num_milliseconds() as f64 / 1000.0})
        })
        .collect();
    let running: Vec<_> = stats
        .running
        .iter()
        .map(|r| {
            json!({"id": r.id, "queue": r.queue, "kind": r.kind, "attempt": r.attempt,
                        "claim_expires_at": r.claim_expires_at})
        })
        .collect();
    out.print(
        json!({"now": stats.now, "queues": queues, "running": running}),
        || {
            let mut text = table(
                &[
                    "queue",
                    "waiting",
                    "running",
                    "completed",
                    "dead",
                    "cancelled",
                    "paused",
                    "oldest waiting",
                ],
                stats.queues.iter().map(|q| {
                    vec![
                        q.queue.clone(),
                        q.waiting.to_string(),
                        q.running.to_string(),
                        q.completed.to_string(),
                        q.dead.to_string(),
                        q.cancelled.to_string(),
                        if q.paused {
                            "yes".into()
                        } else {
                            String::new()
                        },
                        if q.waiting > 0 {
                            age(q.oldest_waiting)
                        } else {
                            String::new()
                        },
                    ]
                }),
            );
            if !stats.running.is_empty() {
                text.push_str("\nrunning jobs (claim expires in):\n");
                text.push_str(&table(
                    &["id", "queue", "kind", "attempt", "expires in"],
                    stats.running.iter().map(|r| {
                        vec![
                            r.id.to_string(),
                            r.queue.clone(),
                            r.kind.clone(),
                            r.attempt.to_string(),
                            r.claim_expires_at
                                .map_or(String::new(), |at| age(at - stats.now)),
                        ]
                    }),
                ));
            }
            text
        },
    );
    Ok(())
}

fn parse_state(state: &str) -> Result<JobState, Failure> {
    Ok(match state {
        "waiting" => JobState::Waiting,
        "running" => JobState::Running,
        "completed" => JobState::Completed,
        "dead" => JobState::Dead,
        "cancelled" => JobState::Cancelled,
        other => return Err(Failure::new(2, format!("unknown state {other:?}"))),
    })
}

fn job_json(job: &jobs::Job) -> serde_json::Value {
    json!({"id": job.id, "queue": job.queue, "kind": job.kind, "state": job.state.as_str(),
           "attempt": job.attempt, "max_attempts": job.max_attempts, "priority": job.priority,
           "due_at": job.due_at, "created_at": job.created_at, "finished_at": job.finished_at,
           "claim_expires_at": job.claim_expires_at, "last_error": job.last_error,
           "lapses": job.lapses, "cancel_requested_at": job.cancel_requested_at,
           "payload": String::from_utf8_lossy(&job.payload)})
}

fn jobs_command(pool: &Pool, command: JobsCommand, out: &Out) -> Outcome {
    let mut conn = pool.get()?;
    match command {
        JobsCommand::List {
            queue,
            state,
            kind,
            limit,
        } => {
            let filter = JobFilter {
                queue,
                state: state.as_deref().map(parse_state).transpose()?,
                kind,
                limit,
                ..JobFilter::default()
            };
            let list = jobs::list(&mut conn, &filter)?;
            out.print(json!(list.iter().map(job_json).collect::<Vec<_>>()), || {
                table(
                    &[
                        "id",
                        "queue",
                        "kind",
                        "state",
                        "attempt",
                        "due",
                        "last error",
                    ],
                    list.iter().map(|j| {
                        vec![
                            j.id.to_string(),
                            j.queue.clone(),
                            j.kind.clone(),
                            j.state.as_str().to_string(),
                            format!("{}/{}", j.attempt, j.max_attempts),
                            j.due_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            output::short(j.last_error.as_deref().unwrap_or(""), 60),
                        ]
                    }),
                )
            });
        }
        JobsCommand::Show { id } => {
            let job =
                jobs::get(&mut conn, id)?.ok_or_else(|| Failure::new(1, format!("no job {id}")))?;
            let history = jobs::history(&mut conn, id)?;
            let outputs = jobs::outputs(&mut conn, id)?;
            let mut value = job_json(&job);
            value["errors"] = json!(history.iter().map(|h| json!({"attempt": h.attempt, "error": h.error, "failed_at": h.failed_at})).collect::<Vec<_>>());
            value["outputs"] = json!(outputs.iter().map(|o| json!({"attempt": o.attempt, "exit_code": o.exit_code, "output": String::from_utf8_lossy(&o.output), "finished_at": o.finished_at})).collect::<Vec<_>>());
            out.print(value.clone(), || {
                let mut text = String::new();
                for (key, value) in value.as_object().into_iter().flatten() {
                    if key == "errors" || key == "outputs" {
                        continue;
                    }
                    text.push_str(&format!("{key:>16}: {}\n", output::plain(value)));
                }
                for h in &history {
                    text.push_str(&format!(
                        "run {} failed at {}: {}\n",
                        h.attempt, h.failed_at, h.error
                    ));
                }
                for o in &outputs {
                    text.push_str(&format!(
                        "run {} exited {} at {}:\n{}\n",
                        o.attempt,
                        o.exit_code
                            .map_or("without a code".into(), |c| c.to_string()),
                        o.finished_at,
                        String::from_utf8_lossy(&o.output).trim_end()
                    ));
                }
                text
            });
        }
        JobsCommand::Retry { id } => {
            if !jobs::retry_dead(&mut conn, id)? {
                return Err(Failure::new(
                    1,
                    format!("job {id} is not dead (or does not exist)"),
                ));
            }
            out.print(json!({"retried": id}), || {
                format!("job {id} will run again")
            });
        }
        JobsCommand::Cancel { id } => {
            if !jobs::cancel(&mut conn, id)? {
                return Err(Failure::new(
                    1,
                    format!(
                        "job {id} is not waiting or running, or was asked to cancel already \
                         (or does not exist)"
                    ),
                ));
            }
            // A running job is asked: it is cancelled when its handler stops.
            let running = jobs::get(&mut conn, id)?.is_some_and(|j| j.state == JobState::Running);
            out.print(json!({"cancelled": id, "running": running}), || {
                if running {
                    format!(
                        "job {id} asked to cancel: its worker stops it at its next heartbeat, \
                         and it is cancelled when its handler returns"
                    )
                } else {
                    format!("job {id} cancelled")
                }
            });
        }
        JobsCommand::Prune {
            queue,
            state,
            keep,
            older_than,
        } => {
            let finished = match state.as_str() {
                "completed" => Finished::Completed,
                "dead" => Finished::Dead,
                "cancelled" => Finished::Cancelled,
                other => {
                    return Err(Failure::new(
                        2,
                        format!("cannot prune {other:?} jobs: completed, dead or cancelled"),
                    ));
                }
            };
            let policy = match (keep, older_than) {
                (Some(n), _) => Retention::KeepNewest(n),
                (None, Some(age)) => Retention::KeepYoungerThan(parse_duration(&age)?),
                (None, None) => Retention::DeleteAll,
            };
            let mut deleted = 0;
            loop {
                let n = jobs::prune(&mut conn, &queue, finished, policy, jobs::MAX_BATCH)?;
                deleted += n;
                if n < jobs::MAX_BATCH {
                    break;
                }
            }
            out.print(json!({"deleted": deleted}), || {
                format!("deleted {deleted} job(s)")
            });
        }
    }
    Ok(())
}

fn leases_command(pool: &Pool, command: LeasesCommand, out: &Out) -> Outcome {
    let mut conn = pool.get()?;
    match command {
        LeasesCommand::List => {
            let leases = dibs::lease::list(&mut conn)?;
            out.print(
                json!(leases.iter().map(|l| json!({"name": l.name, "holder": l.holder, "fence": l.fence, "held": l.held,
                    "acquired_at": l.acquired_at, "expires_at": l.expires_at})).collect::<Vec<_>>()),
                || {
                    table(
                        &["name", "holder", "fence", "held", "expires in"],
                        leases.iter().map(|l| {
                            vec![
                                l.name.clone(),
                                l.holder.clone(),
                                l.fence.to_string(),
                                if l.held { "yes".into() } else { "no".into() },
                                if l.held { age(l.expires_at - l.now) } else { String::new() },
                            ]
                        }),
                    )
                },
            );
        }
        LeasesCommand::Release { name, force } => {
            if !force {
                return Err(Failure::new(
                    2,
                    "releasing a lease someone may hold needs --force (its holder is not told)",
                ));
            }
            let released = dibs::lease::force_release(&mut conn, &name)?;
            if !released {
                return Err(Failure::new(1, format!("no lease {name:?} is held")));
            }
            out.print(json!({"released": name}), || format!("released {name:?}"));
        }
        // Dispatched in `run`, before a pool of this size is opened.
        LeasesCommand::Run(_) => {
            return Err(Failure::new(1, "`lease run` reached the wrong place"));
        }
    }
    Ok(())
}

fn new_job(args: &JobArgs) -> Result<NewJob, Failure> {
    let payload = match (&args.command, &args.payload) {
        (Some(command), _) => work::shell_payload(command, &args.env)?,
        (None, Some(payload)) => payload.clone().into_bytes(),
        (None, None) => Vec::new(),
    };
    Ok(
        NewJob::new(args.queue.as_str(), args.kind.as_str(), payload)
            .priority(args.priority)
            .max_attempts(args.max_attempts),
    )
}

fn enqueue(pool: &Pool, args: EnqueueArgs, out: &Out) -> Outcome {
    let mut job = new_job(&args.job)?;
    if let Some(delay) = &args.delay {
        job = job.delay(parse_duration(delay)?);
    }
    if let Some(key) = &args.dedup_key {
        job = job.dedup_key(key.as_str());
    }
    let enqueued = jobs::enqueue(&mut pool.get()?, &job)?;
    out.print(
        json!({"id": enqueued.id, "existing": enqueued.existing}),
        || {
            if enqueued.existing {
                format!("job {} already waiting with that key", enqueued.id)
            } else {
                format!("enqueued job {}", enqueued.id)
            }
        },
    );
    Ok(())
}

fn schedules_command(pool: &Pool, command: SchedulesCommand, out: &Out) -> Outcome {
    let mut conn = pool.get()?;
    let changed = |done: bool, name: &str, what: &str| -> Outcome {
        if !done {
            return Err(Failure::new(1, format!("no schedule {name:?}")));
        }
        out.print(json!({what: name}), || format!("{what} {name:?}"));
        Ok(())
    };
    match command {
        SchedulesCommand::List => {
            let list = schedules::list(&mut conn)?;
            let spec = |s: &schedules::ScheduleInfo| match &s.spec {
                schedules::Spec::Cron(expr) => format!("cron {expr} ({})", s.time_zone),
                schedules::Spec::Every(every) => format!("every {every:?}"),
            };
            out.print(
                json!(list.iter().map(|s| json!({"name": s.name, "when": spec(s), "queue": s.queue, "kind": s.kind,
                    "paused": s.paused, "next_due_at": s.next_due_at})).collect::<Vec<_>>()),
                || {
                    table(
                        &["name", "when", "queue", "kind", "paused", "next tick"],
                        list.iter().map(|s| {
                            vec![
                                s.name.clone(),
                                spec(s),
                                s.queue.clone(),
                                s.kind.clone(),
                                if s.paused { "yes".into() } else { String::new() },
                                s.next_due_at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
                            ]
                        }),
                    )
                },
            );
            Ok(())
        }
        SchedulesCommand::Add {
            name,
            cron,
            every,
            time_zone,
            job,
        } => {
            let job = new_job(&job)?;
            let schedule = match (cron, every) {
                (Some(expr), _) => Schedule::cron(name.as_str(), expr, job).time_zone(time_zone),
                (None, Some(every)) => Schedule::every(name.as_str(), parse_duration(&every)?, job),
                (None, None) => return Err(Failure::new(2, "give --cron or --every")),
            };
            schedules::upsert(&mut conn, &schedule)?;
            out.print(json!({"added": name}), || {
                format!("schedule {name:?} added")
            });
            Ok(())
        }
        SchedulesCommand::Pause { name } => {
            changed(schedules::pause(&mut conn, &name)?, &name, "paused")
        }
        SchedulesCommand::Resume { name } => {
            changed(schedules::resume(&mut conn, &name)?, &name, "resumed")
        }
        SchedulesCommand::Remove { name } => {
            changed(schedules::remove(&mut conn, &name)?, &name, "removed")
        }
    }
}

/// `500ms`, `30s`, `5m`, `2h`, `7d`, or a plain number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, Failure> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let bad = || {
        Failure::new(
            2,
            format!("{text:?} is not a duration (e.g. 500ms, 30s, 5m, 2h, 7d)"),
        )
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    let millis = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(millis)
        .map(Duration::from_millis)
        .ok_or_else(bad)
}

//! `tenure jobs`: list, show, retry, cancel and prune jobs; answer parked ones
//! (`park_commands.rs`).

use clap::{Subcommand, ValueEnum};
use serde_json::{Value, json};
use tenure::Pool;
use tenure::jobs::{self, Finished, Job, JobFilter, JobState, Retention, RunWhen};

use crate::duration::parse_flag_bounded;
use crate::job_links::Links;
use crate::output::{self, Out, age, clean, table};
use crate::park_commands::{self, TokenSource};
use crate::work::SHELL;
use crate::{Failure, Outcome};

#[derive(Subcommand)]
pub enum JobsCommand {
    /// Jobs, newest first.
    List {
        #[arg(long)]
        queue: Option<String>,
        #[arg(long, value_enum)]
        state: Option<State>,
        #[arg(long)]
        kind: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// With --json: show the values of shell jobs' --env variables (masked otherwise).
        #[arg(long)]
        reveal_env: bool,
    },
    /// One job: its fields, the jobs it waits for, its progress, result, error history and
    /// recorded outputs. The values of a shell job's --env variables are masked (they are
    /// often secrets) unless given --reveal-env. With --json a bytes result is given in hex.
    Show {
        id: i64,
        /// Show the values of the job's --env variables.
        #[arg(long)]
        reveal_env: bool,
    },
    /// Run a dead job again from its first attempt.
    Retry { id: i64 },
    /// Let the rest of a sequence go on past its dead or cancelled job ID, as if it had
    /// completed (`tenure jobs retry ID` runs it again instead).
    SkipInSequence { id: i64 },
    /// Complete a parked job by its token, read from --token-file or standard input (never
    /// the command line: others see it in `ps`). Exit 8: the token was refused.
    CompleteParked {
        #[command(flatten)]
        token: TokenSource,
        /// The job's result, as JSON.
        #[arg(long)]
        result: Option<String>,
    },
    /// Fail a parked job by its token (see complete-parked): retried with backoff while
    /// attempts remain, else dead.
    FailParked {
        #[command(flatten)]
        token: TokenSource,
        /// The error kept with the job.
        #[arg(long)]
        error: String,
    },
    /// Resume a parked job by its token (see complete-parked): waiting again, its next run
    /// reading the value.
    ResumeParked {
        #[command(flatten)]
        token: TokenSource,
        /// The value its next run reads, as JSON.
        #[arg(long)]
        value: Option<String>,
    },
    /// Cancel a blocked, waiting or parked job, or ask a running one to stop.
    Cancel { id: i64 },
    /// Delete finished jobs of a queue.
    Prune {
        #[arg(long)]
        queue: String,
        #[arg(long, value_enum, default_value_t = FinishedState::Completed)]
        state: FinishedState,
        /// Keep the newest N.
        #[arg(long, conflicts_with = "older_than")]
        keep: Option<u64>,
        /// Delete those finished longer ago than this: a whole number and a unit, ms, s, m, h
        /// or d (e.g. 7d, 12h, 30m).
        #[arg(long)]
        older_than: Option<String>,
    },
    /// Set or clear a queue-wide concurrency limit: at most N jobs of the queue run at once,
    /// across every worker.
    LimitQueue {
        queue: String,
        /// The most running jobs (1 to 10000).
        #[arg(required_unless_present = "clear", conflicts_with = "clear")]
        max_running: Option<u32>,
        /// Remove the queue's limit.
        #[arg(long)]
        clear: bool,
    },
}

/// A job's state, as `--state` takes it.
#[derive(Clone, Copy, ValueEnum)]
pub enum State {
    Blocked,
    Waiting,
    Running,
    Parked,
    Completed,
    Dead,
    Cancelled,
}

impl From<State> for JobState {
    fn from(state: State) -> Self {
        match state {
            State::Blocked => JobState::Blocked,
            State::Waiting => JobState::Waiting,
            State::Running => JobState::Running,
            State::Parked => JobState::Parked,
            State::Completed => JobState::Completed,
            State::Dead => JobState::Dead,
            State::Cancelled => JobState::Cancelled,
        }
    }
}

/// The states `prune` deletes.
#[derive(Clone, Copy, ValueEnum)]
pub enum FinishedState {
    Completed,
    Dead,
    Cancelled,
}

/// A job's payload for output: JSON when it is, text otherwise; a shell job's environment
/// values masked unless `reveal`.
fn payload(job: &Job, reveal: bool) -> Value {
    let Ok(mut value) = serde_json::from_slice::<Value>(&job.payload) else {
        return json!(String::from_utf8_lossy(&job.payload));
    };
    if !reveal {
        crate::work::mask_env(&job.kind, &mut value);
    }
    value
}

/// The payload as text (as stored, but with masked values).
fn payload_text(job: &Job, reveal: bool) -> String {
    match serde_json::from_slice::<Value>(&job.payload) {
        Ok(_) => payload(job, reveal).to_string(),
        Err(_) => String::from_utf8_lossy(&job.payload).into_owned(),
    }
}

fn job_json(job: &Job, reveal: bool) -> Value {
    json!({"id": job.id, "queue": job.queue, "kind": job.kind, "state": job.state.as_str(),
           "attempt": job.attempt, "max_attempts": job.max_attempts, "priority": job.priority,
           "due_at": job.due_at, "created_at": job.created_at, "claimed_at": job.claimed_at,
           "finished_at": job.finished_at, "claim_expires_at": job.claim_expires_at,
           "last_error": job.last_error, "lapses": job.lapses, "dedup_key": job.dedup_key,
           "cancel_requested_at": job.cancel_requested_at, "workflow_id": job.workflow_id,
           "run_when": job.run_when.map(RunWhen::as_str), "progress": job.progress,
           "progress_message": job.progress_message, "sequence_key": job.sequence_key,
           "payload": payload_text(job, reveal)})
}

/// `jobs show` for people: what the job is, where it stands, when, what went wrong, what it
/// carries; empty fields left out.
fn show_text(job: &Job, limits: &[jobs::Limit], links: &Links, reveal: bool) -> String {
    let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
    };
    let mut fields: Vec<(&str, Option<String>)> = vec![
        ("id", Some(job.id.to_string())),
        ("queue", Some(job.queue.clone())),
        ("kind", Some(job.kind.clone())),
        ("state", Some(job.state.as_str().to_string())),
        (
            "attempts",
            Some(format!("{} of {}", job.attempt, job.max_attempts)),
        ),
        ("priority", Some(job.priority.to_string())),
    ];
    fields.extend(links.fields(job));
    fields.extend([
        ("created", time(Some(job.created_at))),
        ("due", time(Some(job.due_at))),
        ("claimed", time(job.claimed_at)),
        ("claim expires", time(job.claim_expires_at)),
        ("cancel asked", time(job.cancel_requested_at)),
        ("finished", time(job.finished_at)),
        ("lapses", (job.lapses > 0).then(|| job.lapses.to_string())),
        ("last error", job.last_error.clone()),
        ("dedup key", job.dedup_key.clone()),
        (
            "dedup window",
            job.dedup_window_micros.map(|us| {
                let window = chrono::Duration::microseconds(us);
                match job.finished_at {
                    Some(at) => format!(
                        "{} (folds duplicates until {})",
                        age(window),
                        (at + window).format("%Y-%m-%d %H:%M:%S%.3f UTC")
                    ),
                    None => age(window),
                }
            }),
        ),
    ]);
    for limit in limits {
        let mut caps = Vec::new();
        if let Some(max) = limit.max_running() {
            caps.push(format!("at most {max} running"));
        }
        if let Some(rate) = limit.rate_cap() {
            let per = chrono::Duration::from_std(rate.per).unwrap_or(chrono::Duration::MAX);
            caps.push(format!("at most {} starts per {}", rate.max, age(per)));
        }
        fields.push((
            "limit",
            Some(format!("{}: {}", limit.key(), caps.join(", "))),
        ));
    }
    let payload = payload(job, reveal);
    match payload.get("command").and_then(Value::as_str) {
        Some(command) if job.kind == SHELL => {
            fields.push(("command", Some(command.to_string())));
            let env = payload.get("env").and_then(Value::as_object);
            for (name, value) in env.into_iter().flatten() {
                let value = value.as_str().map_or(value.to_string(), str::to_string);
                fields.push(("env", Some(format!("{name}={value}"))));
            }
            let passed_on = payload.get("env_from").and_then(Value::as_array);
            for name in passed_on.into_iter().flatten().filter_map(Value::as_str) {
                fields.push(("env", Some(format!("{name} from the worker's environment"))));
            }
        }
        _ => fields.push(("payload", Some(payload.to_string()))),
    }
    let mut text = String::new();
    for (name, value) in fields {
        match (name, value) {
            (_, None) => {}
            ("", Some(more)) => text.push_str(&format!("{:15}{more}\n", "")),
            (name, Some(value)) => text.push_str(&format!("{name:>13}: {}\n", clean(&value))),
        }
    }
    if job.kind == SHELL && !reveal && payload.get("env").is_some_and(|e| e != &json!({})) {
        text.push_str("(env values masked: --reveal-env shows them)\n");
    }
    text
}

/// A job's park for `jobs show`: when, its deadline, and how its token was used.
fn park_text(park: &jobs::ParkRecord) -> String {
    let at = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string();
    let answer = match (&park.answer, park.answered_at) {
        (Some(answer), Some(when)) => format!("{answer}, at {}", at(when)),
        _ => "none yet".to_string(),
    };
    format!(
        "{:>13}: {}\n{:>13}: {}\n{:>13}: {answer}\n",
        "parked",
        at(park.parked_at),
        "park deadline",
        at(park.deadline),
        "park answer"
    )
}

/// A job's completed steps for `jobs show`: name, when, size and the start of the result.
fn steps_text(steps: &[jobs::JobStep]) -> String {
    let mut text = String::new();
    for step in steps {
        text.push_str(&format!(
            "step {} done at {} ({} bytes): {}\n",
            clean(&step.name),
            step.created_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
            step.result.len(),
            clean(&output::short(&String::from_utf8_lossy(&step.result), 60))
        ));
    }
    text
}

/// `prune --older-than`: at most 366 days, checked before the database is opened.
fn retention(keep: Option<u64>, older_than: Option<&str>) -> Result<Retention, Failure> {
    Ok(match (keep, older_than) {
        (Some(n), _) => Retention::KeepNewest(n),
        (None, Some(age)) => Retention::KeepYoungerThan(parse_flag_bounded(
            "--older-than",
            age,
            std::time::Duration::ZERO,
        )?),
        (None, None) => Retention::DeleteAll,
    })
}

pub fn run(
    open: impl FnOnce() -> Result<Pool, Failure>,
    command: JobsCommand,
    out: &Out,
) -> Outcome {
    // Arguments are checked before the database is opened.
    if let JobsCommand::Prune {
        keep, older_than, ..
    } = &command
    {
        retention(*keep, older_than.as_deref())?;
    }
    let pool = open()?;
    let mut conn = pool.get()?;
    match command {
        JobsCommand::List {
            queue,
            state,
            kind,
            limit,
            reveal_env,
        } => {
            let filter = JobFilter {
                queue,
                state: state.map(JobState::from),
                kind,
                limit,
                ..JobFilter::default()
            };
            let list = jobs::list(&mut conn, &filter)?;
            let value = json!(
                list.iter()
                    .map(|j| job_json(j, reveal_env))
                    .collect::<Vec<_>>()
            );
            out.print(value, || {
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
            })
        }
        JobsCommand::Show { id, reveal_env } => {
            let job =
                jobs::get(&mut conn, id)?.ok_or_else(|| Failure::new(1, format!("no job {id}")))?;
            let history = jobs::history(&mut conn, id)?;
            let outputs = jobs::outputs(&mut conn, id)?;
            let limits = jobs::limits_of(&mut conn, id)?;
            let steps = jobs::steps(&mut conn, id)?;
            let park = jobs::park_record(&mut conn, id)?;
            let links = Links::load(&mut conn, &job)?;
            let mut value = job_json(&job, reveal_env);
            links.add_json(&mut value);
            value["dedup_window_seconds"] =
                json!(job.dedup_window_micros.map(|us| us as f64 / 1e6));
            value["limits"] = json!(limits.iter().map(|l| json!({"key": l.key(), "max_running": l.max_running(), "rate_max": l.rate_cap().map(|r| r.max), "rate_per_seconds": l.rate_cap().map(|r| r.per.as_secs_f64())})).collect::<Vec<_>>());
            value["errors"] = json!(history.iter().map(|h| json!({"attempt": h.attempt, "error": h.error, "failed_at": h.failed_at})).collect::<Vec<_>>());
            value["outputs"] = json!(outputs.iter().map(|o| json!({"attempt": o.attempt, "exit_code": o.exit_code, "output": String::from_utf8_lossy(&o.output), "finished_at": o.finished_at})).collect::<Vec<_>>());
            value["steps"] = json!(steps.iter().map(|s| json!({"name": s.name, "created_at": s.created_at, "bytes": s.result.len(), "result": serde_json::from_slice::<Value>(&s.result).unwrap_or_else(|_| json!(String::from_utf8_lossy(&s.result)))})).collect::<Vec<_>>());
            value["park"] = json!(park.as_ref().map(|p| json!({"parked_at": p.parked_at, "deadline": p.deadline, "answer": p.answer, "answered_at": p.answered_at})));
            out.print(value, || {
                let mut text = show_text(&job, &limits, &links, reveal_env);
                if let Some(p) = &park {
                    text.push_str(&park_text(p));
                }
                text.extend(links.result_text());
                text.push_str(&steps_text(&steps));
                for h in &history {
                    text.push_str(&format!(
                        "run {} failed at {}: {}\n",
                        h.attempt,
                        h.failed_at,
                        clean(&h.error)
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
            })
        }
        JobsCommand::Retry { id } => {
            if !jobs::retry_dead(&mut conn, id)? {
                let why = match jobs::get(&mut conn, id)? {
                    None => format!("no job {id}"),
                    Some(job) => format!(
                        "job {id} is {}, not dead: only dead jobs can be retried",
                        job.state.as_str()
                    ),
                };
                return Err(Failure::new(1, why));
            }
            out.print(json!({"retried": id}), || {
                format!("job {id} will run again")
            })
        }
        JobsCommand::SkipInSequence { id } => {
            let released = jobs::skip_in_sequence(&mut conn, id)?;
            if released == 0 {
                let why = match jobs::get(&mut conn, id)? {
                    None => format!("no job {id}"),
                    Some(job) => format!(
                        "job {id} is {} and holds no job of a sequence back: only a dead or \
                         cancelled job of a held sequence can be skipped",
                        job.state.as_str()
                    ),
                };
                return Err(Failure::new(1, why));
            }
            out.print(json!({"skipped": id, "released": released}), || {
                format!("the sequence goes on past job {id}: {released} job(s) released")
            })
        }
        JobsCommand::CompleteParked { token, result } => {
            park_commands::complete(&pool, out, &token, result.as_deref())
        }
        JobsCommand::FailParked { token, error } => park_commands::fail(&pool, out, &token, &error),
        JobsCommand::ResumeParked { token, value } => {
            park_commands::resume(&pool, out, &token, value.as_deref())
        }
        JobsCommand::Cancel { id } => {
            if !jobs::cancel(&mut conn, id)? {
                let why = match jobs::get(&mut conn, id)? {
                    None => format!("no job {id}"),
                    Some(job) if job.cancel_requested_at.is_some() => {
                        format!("job {id} was asked to cancel already")
                    }
                    Some(job) => format!(
                        "job {id} is {}: only blocked, waiting, parked or running jobs can be cancelled",
                        job.state.as_str()
                    ),
                };
                return Err(Failure::new(1, why));
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
            })
        }
        JobsCommand::Prune {
            queue,
            state,
            keep,
            older_than,
        } => {
            let finished = match state {
                FinishedState::Completed => Finished::Completed,
                FinishedState::Dead => Finished::Dead,
                FinishedState::Cancelled => Finished::Cancelled,
            };
            let policy = retention(keep, older_than.as_deref())?;
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
            })
        }
        JobsCommand::LimitQueue {
            queue, max_running, ..
        } => {
            jobs::limit_queue(&mut conn, &queue, max_running)?;
            out.print(
                json!({"queue": queue, "max_running": max_running}),
                || match max_running {
                    Some(max) => format!("queue {queue}: at most {max} running job(s)"),
                    None => format!("queue {queue}: no limit"),
                },
            )
        }
    }
}

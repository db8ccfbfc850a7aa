//! `tenure enqueue`, and the job a schedule enqueues: refused unless some worker could run it.

use clap::Args;
use serde_json::json;
use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob};
use tenure::{Error, Pool};

use crate::duration::{format_duration, parse_flag, parse_flag_bounded};
use crate::output::Out;
use crate::work::{self, SHELL};
use crate::{Failure, Outcome};

#[derive(Args)]
pub struct JobArgs {
    /// The queue to put the job on (`tenure work --queue Q` serves it).
    #[arg(long)]
    queue: String,
    /// The job's kind (`shell` for `tenure work`).
    #[arg(long, default_value = SHELL)]
    kind: String,
    /// For `shell` jobs (required): the command line (run by /bin/sh -c).
    #[arg(long, conflicts_with = "payload")]
    command: Option<String>,
    /// For `shell` jobs: an environment variable of the command, NAME=VALUE (repeatable).
    /// `tenure jobs show` masks the values unless given --reveal-env.
    #[arg(long = "env", requires = "command")]
    env: Vec<String>,
    /// For `shell` jobs: the name of a variable the worker passes on from its own
    /// environment when it runs the command (repeatable). Only the name is stored: the way to
    /// give a command a secret. A worker without it fails the run, saying which.
    #[arg(long = "env-from", requires = "command", value_name = "NAME")]
    env_from: Vec<String>,
    /// For other kinds: the payload, JSON (e.g. '{"id": 42}' or '"text"'); JSON null if
    /// not given.
    #[arg(long)]
    payload: Option<String>,
    /// Among the queue's due jobs, lower numbers are claimed first (any integer: -1 before 0).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    priority: i32,
    /// Runs in all before a failing job ends dead. The default, 3, tries a failing command
    /// twice more (after `tenure work --retry-after`, doubled), then leaves it dead for
    /// `tenure jobs show` and `tenure jobs retry`.
    #[arg(long, default_value_t = 3)]
    max_attempts: u32,
}

#[derive(Args)]
pub struct EnqueueArgs {
    #[command(flatten)]
    job: JobArgs,
    /// Run it after this long: a whole number and a unit, ms, s, m, h or d (e.g. 10s, 5m).
    #[arg(long)]
    delay: Option<String>,
    /// Do not enqueue if a live job of the queue has this key.
    #[arg(long)]
    dedup_key: Option<String>,
    /// Run after the job enqueued before it with this sequence key has completed (one at a
    /// time, in enqueue order); if one ends dead or cancelled the rest wait for `tenure jobs
    /// retry` or `tenure jobs skip-in-sequence`
    #[arg(long)]
    sequence: Option<String>,
    /// Share the queue fairly with other tenants: the job takes this tenant's next turn
    /// (claims take the tenants' turns in order, within a priority).
    #[arg(long)]
    fair_key: Option<String>,
    /// Wait until the job ends, print how (and its result), and exit with a code that says
    /// it: 0 completed, 5 dead, 6 cancelled, 7 not ended within --timeout.
    #[arg(long)]
    wait: bool,
    /// With --wait: how long to wait at most (e.g. 30s, 5m; default 1h).
    #[arg(long, requires = "wait")]
    timeout: Option<String>,
}

/// `--wait`'s exit codes for a job that did not complete.
const DEAD: u8 = 5;
const CANCELLED: u8 = 6;
const NOT_ENDED: u8 = 7;

/// The job the arguments describe, or exit code 2 if no worker could ever run it: a `shell`
/// job without a command, a payload that is not JSON.
pub fn new_job(args: &JobArgs) -> Result<NewJob, Failure> {
    let payload = match (args.kind == SHELL, &args.command, &args.payload) {
        (true, Some(command), _) => work::shell_payload(command, &args.env, &args.env_from)?,
        (true, None, Some(payload)) => {
            // A shell job's payload written out by hand must still be one.
            work::check_shell_payload(payload.as_bytes()).map_err(|why| {
                Failure::new(
                    2,
                    format!(
                        "--payload of a `shell` job must be {{\"command\": \"...\", \"env\": \
                         {{...}}}} ({why}); give the command line with --command instead"
                    ),
                )
            })?;
            payload.clone().into_bytes()
        }
        (true, None, None) => {
            return Err(Failure::new(
                2,
                "a `shell` job needs --command 'COMMAND LINE' (what `tenure work` runs with \
                 /bin/sh -c); for a job of your own program, give --kind KIND and --payload JSON",
            ));
        }
        (false, Some(_), _) => {
            return Err(Failure::new(
                2,
                format!(
                    "--command is for `shell` jobs, but the kind is {:?}: drop --kind, or give \
                     the job's data with --payload JSON",
                    args.kind
                ),
            ));
        }
        (false, None, Some(payload)) => {
            serde_json::from_str::<serde_json::Value>(payload).map_err(|e| {
                Failure::new(
                    2,
                    format!(
                        "--payload is not JSON ({e}): handlers decode it as JSON; quote text \
                         as a JSON string, e.g. --payload '\"hello\"', or give an object, e.g. \
                         --payload '{{\"id\": 42}}'"
                    ),
                )
            })?;
            payload.clone().into_bytes()
        }
        (false, None, None) => b"null".to_vec(),
    };
    Ok(
        NewJob::new(args.queue.as_str(), args.kind.as_str(), payload)
            .priority(args.priority)
            .max_attempts(args.max_attempts),
    )
}

pub fn enqueue(
    open: impl FnOnce() -> Result<Pool, Failure>,
    args: EnqueueArgs,
    out: &Out,
) -> Outcome {
    let mut job = new_job(&args.job)?;
    if let Some(delay) = &args.delay {
        job = job.delay(parse_flag_bounded("--delay", delay, Duration::ZERO)?);
    }
    if let Some(key) = &args.fair_key {
        job = job.fair_key(key.as_str());
    }
    if let Some(key) = &args.sequence {
        job = job.sequence(key.as_str());
    }
    if let Some(key) = &args.dedup_key {
        job = job.dedup_key(key.as_str());
    }
    let timeout = match (&args.wait, &args.timeout) {
        (true, Some(text)) => Some(parse_flag("--timeout", text)?),
        (true, None) => Some(Duration::from_secs(3600)),
        (false, _) => None,
    };
    let pool = open()?;
    let enqueued = jobs::enqueue(&mut pool.get()?, &job)?;
    let Some(timeout) = timeout else {
        return out.print(
            json!({"id": enqueued.id, "existing": enqueued.existing}),
            || {
                if enqueued.existing {
                    format!("job {} already waiting with that key", enqueued.id)
                } else {
                    format!("enqueued job {}", enqueued.id)
                }
            },
        );
    };
    let id = enqueued.id;
    let ended = match jobs::wait(&pool, id, timeout) {
        Ok(ended) => ended,
        Err(Error::WaitTimedOut { state, .. }) => {
            out.print(
                json!({"id": id, "existing": enqueued.existing, "state": state.as_str(), "ended": false}),
                || format!("job {id} has not ended within {}: it is {}", format_duration(timeout), state.as_str()),
            )?;
            return Err(Failure::new(NOT_ENDED, String::new()));
        }
        Err(e) => return Err(e.into()),
    };
    let state = ended.job.state;
    let result = ended.result.as_ref().map(|result| {
        if result.is_json() {
            serde_json::from_slice(result.as_bytes()).unwrap_or(serde_json::Value::Null)
        } else {
            serde_json::Value::String(String::from_utf8_lossy(result.as_bytes()).into_owned())
        }
    });
    out.print(
        json!({
            "id": id,
            "existing": enqueued.existing,
            "state": state.as_str(),
            "ended": true,
            "result": result,
            "error": ended.job.last_error,
        }),
        || {
            let mut text = format!("job {id} {}", state.as_str());
            if let Some(error) = &ended.job.last_error
                && state != JobState::Completed
            {
                text += &format!(": {error}");
            }
            if let Some(result) = &result {
                text += &format!("\n{result}");
            }
            text
        },
    )?;
    match state {
        JobState::Completed => Ok(()),
        JobState::Cancelled => Err(Failure::new(CANCELLED, String::new())),
        _ => Err(Failure::new(DEAD, String::new())),
    }
}

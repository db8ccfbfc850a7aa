//! `tenure work`: a durable task spooler. Jobs of kind `shell` carry a command line and its
//! environment; this runs them with `/bin/sh -c`, keeps their output and exit status with
//! the job, and retries failures.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use tenure::Pool;
use tenure::jobs::{self, Backoff};
use tenure::worker::{JobContext, JobError, Worker};

use crate::duration::{format_duration, parse_flag};
use crate::{Failure, Outcome, children, database};

/// The kind of job `tenure work` runs.
pub const SHELL: &str = "shell";

/// What masked values show instead.
pub const MASK: &str = "•••";

/// Masks a shell job's environment values in its decoded payload: they may be secrets, and
/// no page, listing or log shows them (`tenure jobs show --reveal-env` asks for them).
pub fn mask_env(kind: &str, payload: &mut serde_json::Value) {
    if kind != SHELL {
        return;
    }
    match payload.get_mut("env") {
        Some(serde_json::Value::Object(env)) => env
            .values_mut()
            .for_each(|v| *v = serde_json::Value::from(MASK)),
        // Not a map (a payload the worker refuses, enqueued through the library): it may
        // still hold `NAME=VALUE` text, so it is masked whole.
        Some(env) => *env = serde_json::Value::from(MASK),
        None => {}
    }
}

/// A job's payload as a person may see it: a shell job's environment values masked (see
/// [`mask_env`]); anything else as stored.
pub fn shown_payload<'a>(kind: &str, payload: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
    if kind != SHELL {
        return payload.into();
    }
    match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(mut value) => {
            mask_env(kind, &mut value);
            value.to_string().into_bytes().into()
        }
        // Not a shell job's payload (the worker cannot run it either): nothing to mask.
        Err(_) => payload.into(),
    }
}

/// What `tenure work --help` says about the command, whatever the help's length.
pub const ABOUT: &str = "\
Runs jobs of kind `shell` (a command line and its environment, run by /bin/sh -c) from the
queues named, on N threads, with retries, timeouts and heartbeats, until Ctrl-C or SIGTERM;
then lets running commands finish within the grace period and gives back the rest. Each
run's output (last 64 KiB) and exit status are kept with the job (`tenure jobs show ID`).

SECURITY: every `shell` job on these queues is a command this worker runs with its own
user's rights. Whoever can write to tenure's tables (or enqueue on these queues) can run
commands on every host where `tenure work` serves them. Give enqueuers' database accounts only
the access they need, and run workers as an unprivileged user.";

#[derive(Args)]
pub struct WorkArgs {
    /// A queue to serve (repeatable; at least one).
    #[arg(long = "queue", required = true)]
    queues: Vec<String>,
    /// Commands run at once.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Kill a command still running after this long, and retry it (e.g. 10m).
    #[arg(long, default_value = "1h")]
    timeout: String,
    /// At Ctrl-C or SIGTERM, how long running commands may take to finish.
    #[arg(long, default_value = "30s")]
    grace: String,
    /// The first retry's delay (doubling up to an hour). How many runs a job gets is its own
    /// --max-attempts, given when it was enqueued (default 3).
    #[arg(long, default_value = "1s")]
    retry_after: String,
    /// How to log each job and the worker's warnings, on stderr: `human` lines or `json`
    /// objects (one per line). RUST_LOG overrides which (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

/// Logs tenure's tracing events (a line per job, rescues, warnings) to stderr; a stderr that
/// is gone is ignored, like tenure's own messages.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(true);
    // A second subscriber (a test calling twice) is refused: keep the first.
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ShellJob {
    command: String,
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// Variables the worker passes on from its own environment when it runs the command:
    /// only their names are stored, so a secret stays out of the table.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    env_from: Vec<String>,
}

/// The payload of a shell job: the command line, `NAME=VALUE` variables, and the names of
/// variables the worker passes on from its own environment.
pub fn shell_payload(
    command: &str,
    env: &[String],
    env_from: &[String],
) -> Result<Vec<u8>, Failure> {
    let mut vars = BTreeMap::new();
    for pair in env {
        // The value is never repeated: it may be a secret.
        let (name, value) = pair
            .split_once('=')
            .filter(|(name, _)| !name.is_empty())
            .ok_or_else(|| {
                let name = pair.split_once('=').map_or("", |(name, _)| name);
                let shown = if pair.contains('=') {
                    format!("{name:?}=…")
                } else {
                    "without `=`".to_string()
                };
                Failure::new(
                    2,
                    format!("an --env ({shown}) is not NAME=VALUE with a non-empty NAME"),
                )
            })?;
        vars.insert(name.to_string(), value.to_string());
    }
    let job = ShellJob {
        command: command.to_string(),
        env: vars,
        env_from: env_from.to_vec(),
    };
    job.runnable().map_err(|why| Failure::new(2, why))?;
    serde_json::to_vec(&job).map_err(|e| Failure::new(1, e.to_string()))
}

impl ShellJob {
    /// Whether /bin/sh can be started with this command and environment: no NUL byte in
    /// them, variable names non-empty and without `=`. Values are not repeated.
    fn runnable(&self) -> Result<(), String> {
        if self.command.contains('\0') {
            return Err("the command holds a NUL byte: no command line can".to_string());
        }
        for (name, value) in &self.env {
            if name.is_empty() || name.contains(['=', '\0']) {
                return Err(format!(
                    "the environment variable name {} is empty or holds `=` or a NUL byte",
                    shown_name(name)
                ));
            }
            if value.contains('\0') {
                return Err(format!("the value of {name} holds a NUL byte"));
            }
        }
        for name in &self.env_from {
            if name.is_empty() || name.contains(['=', '\0']) {
                return Err(format!(
                    "the --env-from name {} is empty or holds `=` or a NUL byte",
                    shown_name(name)
                ));
            }
        }
        Ok(())
    }
}

/// A variable name as an error may show it: what follows a `=` in it is left out, since
/// `--env-from TOKEN=s3cr3t` (taken for `--env`) puts a value there.
fn shown_name(name: &str) -> String {
    match name.split_once('=') {
        Some((before, _)) => format!("{before:?}=…"),
        None => format!("{name:?}"),
    }
}

/// Whether `payload` is a shell job's (`{"command": ..., "env": {...}}`), and if not why.
pub fn check_shell_payload(payload: &[u8]) -> Result<(), String> {
    decode_shell(payload)?.runnable()
}

/// A shell job's payload decoded, or why not in words that repeat no value of it.
fn decode_shell(payload: &[u8]) -> Result<ShellJob, String> {
    serde_json::from_slice::<ShellJob>(payload).map_err(|e| {
        // serde repeats a value of the wrong type ("invalid type: string \"TOKEN=...\""),
        // which may be a secret: say where it is instead.
        let text = e.to_string();
        if text.starts_with("invalid type") || text.starts_with("invalid value") {
            format!(
                "a value of the wrong type at line {} column {}",
                e.line(),
                e.column()
            )
        } else {
            text
        }
    })
}

pub fn run(target: &database::Target, args: WorkArgs) -> Outcome {
    let timeout = parse_flag("--timeout", &args.timeout)?;
    let grace = parse_flag("--grace", &args.grace)?;
    let retry_after = parse_flag("--retry-after", &args.retry_after)?;
    let threads = args.threads;
    init_logging(args.log_format);
    let pool = database::open(target, threads as u32 * 2 + 4, true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .map_err(|e| Failure::new(1, format!("cannot catch Ctrl-C: {e}")))?;
    let outputs = pool.clone();
    let mut builder = Worker::builder(pool)
        .threads(threads)
        .backoff(Backoff {
            base: retry_after,
            max: Duration::from_secs(3600),
        })
        // Decoded here, not by `handler`, whose error for an undecodable payload repeats
        // serde's, values included (an `env` given as "TOKEN=..." text): it would be the
        // job's error, on every page and in the log.
        .raw_handler(SHELL, move |ctx: &JobContext, payload: &[u8]| {
            let job = decode_shell(payload).map_err(|why| {
                JobError::dead(format!("the payload is not a shell job's: {why}"))
            })?;
            run_command(&outputs, ctx, &job)
        })
        .timeout(SHELL, timeout);
    for queue in &args.queues {
        builder = builder.queue(queue.as_str());
    }
    let worker = builder.start()?;
    say(&format!(
        "running `{SHELL}` jobs of {} on {threads} threads; Ctrl-C to stop",
        args.queues.join(", ")
    ));
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    say(&format!("stopping (grace {})", format_duration(grace)));
    let report = worker.shutdown(grace);
    say(&format!(
        "{} completed, {} retried, {} snoozed, {} dead, {} given back",
        report.completed, report.retried, report.snoozed, report.dead, report.given_back
    ));
    Ok(())
}

/// A status line on stderr, ignoring a stderr that is gone (a closed pipe): the worker's
/// exit status must not become a panic's.
fn say(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "tenure work: {text}");
}

/// Runs one command in its own process group (a terminal's Ctrl-C reaches the worker, which
/// decides), collects its output (the tail is kept), kills it when the run must stop
/// (timeout, cancel, lost claim, shutdown), and records output and exit status.
fn run_command(pool: &Pool, ctx: &JobContext, job: &ShellJob) -> Result<(), JobError> {
    let mut passed_on = Vec::with_capacity(job.env_from.len());
    for name in &job.env_from {
        // Another worker may have it: a failed run (retried), saying which is missing.
        let value = std::env::var_os(name).ok_or_else(|| {
            JobError::retry(format!(
                "this worker's environment has no {name} (the job's --env-from)"
            ))
        })?;
        passed_on.push((name, value));
    }
    // Started before the command, so that the command never runs unwatched: it ends the
    // command's group when this worker dies, even by SIGKILL, before its job can be rescued
    // and run again beside it.
    let mut watchdog = crate::watchdog::Watchdog::start(Duration::ZERO)
        .map_err(|e| JobError::retry(format!("cannot start the command's watchdog: {e}")))?;
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(&job.command)
        .envs(&job.env)
        .envs(passed_on)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // Nothing of this process (its database connections) reaches the command.
    children::inherit_only_stdio(&mut command);
    #[cfg(target_os = "linux")]
    // SAFETY: only an async-signal-safe system call between fork and exec.
    unsafe {
        // The shell at least dies with this thread, should the watchdog die first.
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = watchdog
        .spawn(&mut command, None)
        .map_err(|e| JobError::retry(format!("cannot start /bin/sh: {e}")))?;
    let group = child.id();
    let output: Arc<Mutex<Vec<u8>>> = Arc::default();
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|mut stream| {
        let output = output.clone();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 8192];
            while let Ok(n) = stream.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                let mut all = output.lock().unwrap_or_else(|e| e.into_inner());
                all.extend_from_slice(&buffer[..n]);
                // Keep a bounded tail.
                let excess = all.len().saturating_sub(2 * jobs::MAX_OUTPUT_BYTES);
                if excess > 0 {
                    all.drain(..excess);
                }
            }
        })
    })
    .collect();
    let mut killed = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(_) => break None,
        }
        if ctx.should_stop() && !killed {
            // The whole group: the shell and what it started.
            children::kill_group(group);
            let _ = child.kill();
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // A child the command put in the background may hold the output open after the shell
    // exited: a timeout or a cancel still ends it.
    while readers.iter().any(|reader| !reader.is_finished()) {
        if ctx.should_stop() && !killed {
            children::kill_group(group);
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for reader in readers {
        let _ = reader.join();
    }
    // The run ends here, and nothing of it outlives it: what is left of its group (a child
    // that closed its output and went on) is ended too. A command that must leave something
    // running detaches it into a session of its own (setsid).
    children::kill_group(group);
    let _ = watchdog.dismiss();
    let output = std::mem::take(&mut *output.lock().unwrap_or_else(|e| e.into_inner()));
    let code = status.and_then(|s| s.code());
    jobs::record_output(&mut pool.get()?, ctx.id, ctx.attempt, code, &output)?;
    match code {
        Some(0) if !killed => Ok(()),
        _ if killed => Err(JobError::retry(
            "the command was killed: the run had to stop",
        )),
        Some(code) => {
            let tail =
                String::from_utf8_lossy(&output[output.len().saturating_sub(500)..]).into_owned();
            let tail = tail.trim_end();
            Err(JobError::retry(if tail.is_empty() {
                format!("exit code {code} (the command printed nothing)")
            } else {
                format!("exit code {code}: {tail}")
            }))
        }
        None => Err(JobError::retry(
            "the command ended without an exit code (killed by a signal)",
        )),
    }
}

//! `tenure lease run NAME -- COMMAND`: runs a command while holding a lease, so runs of the same
//! name never overlap (cron jobs on several hosts, deploy steps, backups).

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Args;
use tenure::lease::{Take, Wait};
use tenure::{LeaseGuard, Pool};

use crate::children::{group_lives, signal_group};
use crate::lease_signals::{
    COMMAND_STARTED, catch_signals, signal_name, signals_pending, take_signals,
    watch_signals_until_the_command_starts,
};
use crate::watchdog::Watchdog;
use crate::{Failure, Outcome, database, duration::parse_flag};

/// Not run: someone else holds the lease (at once with `--no-wait`, or after `--wait`).
pub const HELD: u8 = 75;
/// The lease was lost while the command ran; the command was stopped.
pub const LOST: u8 = 76;

/// What `tenure lease run --help` ends with.
pub const ABOUT: &str = "\
Takes the lease NAME (waiting up to --wait for its holder to let go), runs COMMAND in its
own process group with TENURE_LEASE_NAME, TENURE_LEASE_FENCE, TENURE_LEASE_TOKEN,
TENURE_LEASE_TTL and TENURE_LEASE_GRACE (both in seconds) in its environment, renews the
lease every ttl/3 while it runs, and releases it when it exits. So two `tenure lease run` of
the same name, on any hosts sharing the database, do not run their commands at once while
each keeps the lease; one that loses it stops its command (below), and the next holder may
start during that command's grace.

If the lease is lost while the command runs (renewals did not succeed in time, or an operator
ran `tenure leases release NAME --force`), the command gets SIGTERM, then SIGKILL after
--grace, and tenure exits 76 saying why. SIGINT, SIGTERM and SIGHUP sent to tenure are
forwarded to the command (SIGKILL after --grace if it keeps running); the lease is released
once it stopped.

While tenure itself is stopped (SIGSTOP, Ctrl-Z) or starved, it cannot stop the command; a
watchdog process does. After each renewal tenure tells it until when the lease is surely held
(0.9 ttl after that renewal was sent; on PostgreSQL and MariaDB, with fast takeover, at most
8 s after the last renewal or check of tenure's liveness lock, so a stop longer than that
ends the command whatever the ttl); if no newer word has come by then, the command's group
gets SIGTERM at that deadline, before the lease can expire, and SIGKILL --grace later, so the
command overlaps the next holder by less than the grace; tenure exits 76 once it continues.
The watchdog has a process group of its own: if it is stopped as well (SIGSTOP sent to it
too, or to its group), nothing stops the command until they continue. If tenure dies, even by
SIGKILL, the watchdog kills the command's group at once.

A command writing to the same database can check that its fence is still current in the
statement that writes (see docs/guide.md: \"The fence check from a shell\").

Exit codes:
  the command's own    it ran with the lease held throughout (128+N if signal N ended it)
  75                   not run: the lease is held by someone else (--no-wait, or --wait ran out)
  76                   the lease was lost while the command ran (or tenure was stopped past its
                       deadline); the command was stopped
  126, 127             the command could not be started (127: not found)
  128+N                signal N (SIGINT 130, SIGTERM 143) arrived while waiting: not run
  1                    a database error before the command started, or no watchdog could start
  2                    bad arguments (empty name, bad --ttl, no command)
  3, 4                 cannot connect; the database has no tenure tables (run `tenure migrate`)";

#[derive(Args)]
pub struct RunArgs {
    /// The lease's name (1 to 255 bytes).
    name: String,
    /// How long the lease lasts without a renewal (at least 1s); renewed every ttl/3.
    #[arg(long, default_value = "30s")]
    ttl: String,
    /// How long to wait for the lease while someone else holds it.
    #[arg(long, default_value = "10m")]
    wait: String,
    /// Exit at once with status 75 when someone else holds the lease.
    #[arg(long, conflicts_with = "wait")]
    no_wait: bool,
    /// How many may hold the lease at once (a semaphore: at most N runs at a time); every
    /// runner of NAME must give the same N.
    #[arg(long, short = 'n', default_value_t = 1)]
    holders: u32,
    /// After the lease lapses or is force-released (not after a clean release), nobody gets
    /// it for this long more, so that a stopped holder's writes in flight land first.
    #[arg(long, default_value = "0s")]
    lock_delay: String,
    /// A label for `tenure leases list` (default: HOST:PID).
    #[arg(long)]
    holder: Option<String>,
    /// After SIGTERM (lease lost) or a forwarded signal, how long the command may take to
    /// stop before SIGKILL.
    #[arg(long, default_value = "10s")]
    grace: String,
    /// Say on stderr when the lease is taken and released.
    #[arg(long, short)]
    verbose: bool,
    /// The command and its arguments, run as given (no shell: use `sh -c '...'` for one).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    command: Vec<OsString>,
}

/// Writes a line to stderr, ignoring a stderr that is gone (a closed pipe): tenure's statuses
/// must not become a panic's.
pub fn warn(text: &str) {
    let _ = writeln!(std::io::stderr(), "tenure lease run: {text}");
}

/// How long to wait for the database to say why a lease was lost before saying what this
/// process knows: a partitioned network can hang a query for as long as TCP keeps trying.
const WHY_WAIT: Duration = Duration::from_secs(5);

fn hostname() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: the buffer is writable for its length; the result is NUL-terminated or cut.
    let ok = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) == 0 };
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    match ok {
        true if end > 0 => String::from_utf8_lossy(&buffer[..end]).into_owned(),
        _ => "localhost".into(),
    }
}

/// A command's exit status as a shell reports it: its code, or 128 + the signal that ended it.
fn status_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(signal)) => (128 + signal).clamp(0, 255) as u8,
        (None, None) => 1,
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by {}", signal_name(signal)),
        (None, None) => "no exit status".into(),
    }
}

pub fn run(target: &database::Target, args: RunArgs) -> Outcome {
    let ttl = parse_flag("--ttl", &args.ttl)?;
    if ttl < Duration::from_secs(1) {
        return Err(Failure::new(
            2,
            format!(
                "--ttl {:?} is too short: at least 1s (it is renewed every ttl/3)",
                args.ttl
            ),
        ));
    }
    let wait = match args.no_wait {
        true => Duration::ZERO,
        false => parse_flag("--wait", &args.wait)?,
    };
    let grace = parse_flag("--grace", &args.grace)?;
    let lock_delay = parse_flag("--lock-delay", &args.lock_delay)?;
    if args.holders == 0 || args.holders > tenure::lease::MAX_HOLDERS {
        return Err(Failure::new(
            2,
            format!(
                "-n {} is out of range: 1 to {}",
                args.holders,
                tenure::lease::MAX_HOLDERS
            ),
        ));
    }
    let holder = args
        .holder
        .clone()
        .unwrap_or_else(|| format!("{}:{}", hostname(), std::process::id()));
    // Bad input is refused before anything touches the database (or creates an SQLite file).
    check_input(&args.name, &holder, ttl)?;
    let name = args.name.as_str();
    let say = |text: String| {
        if args.verbose {
            warn(&text);
        }
    };
    catch_signals()?;
    watch_signals_until_the_command_starts();
    // One connection the guard keeps for its renewals, fresh ones after a failure, and one to
    // say why a lease was lost.
    let pool = database::open(target, 4, true)?;

    let terms = Take::new(name, ttl, &holder)
        .holders(args.holders)
        .lock_delay(lock_delay);
    let guard = take(&pool, &terms, wait, args.no_wait, &say)?;
    let fence = guard.fence();
    say(format!("took {name:?} (fence {fence}) as {holder:?}"));
    database::warn_if_fences_may_repeat(&pool, fence, warn);

    // Started before the command, so that the command never runs unwatched.
    let mut watchdog = match Watchdog::start(grace) {
        Ok(watchdog) => watchdog,
        Err(e) => {
            let _ = guard.release();
            return Err(Failure::new(
                1,
                format!("cannot start the command's watchdog: {e}; the command did not run"),
            ));
        }
    };
    let program = &args.command[0];
    let mut command = Command::new(program);
    command
        .args(&args.command[1..])
        .env("TENURE_LEASE_NAME", name)
        .env("TENURE_LEASE_FENCE", fence.to_string())
        .env("TENURE_LEASE_TOKEN", guard.lease().token().to_string())
        // So that the command can bound its own steps: it is stopped within 0.9 ttl of the
        // last renewal, and has the grace after SIGTERM.
        .env("TENURE_LEASE_TTL", ttl.as_secs_f64().to_string())
        .env("TENURE_LEASE_GRACE", grace.as_secs_f64().to_string())
        // Its own group: we signal it and what it started as one, and a terminal's Ctrl-C
        // reaches tenure, which forwards it.
        .process_group(0);
    if std::io::stdin().is_terminal() {
        // A background process group reading the terminal would be stopped (SIGTTIN).
        command.stdin(Stdio::null());
    }
    // Nothing of this process (its database connections) reaches the command.
    crate::children::inherit_only_stdio(&mut command);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe system calls between fork and exec.
        unsafe {
            command.pre_exec(move || {
                // If tenure itself is killed (SIGKILL cannot be caught), the command does not
                // outlive the lease.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                    || libc::getppid() != parent
                {
                    return Err(std::io::Error::other(
                        "tenure exited before the command started",
                    ));
                }
                Ok(())
            });
        }
    }
    COMMAND_STARTED.store(true, Ordering::SeqCst);
    // A stop between the spawn and the supervising loop counts as a gap too.
    let spawned_at = Instant::now();
    let child = match watchdog.spawn(&mut command, guard.held_until()) {
        Ok(child) => child,
        Err(e) => {
            let _ = guard.release();
            // The command's own process tells the watchdog its group before it runs: a
            // watchdog gone by then fails the spawn with a broken pipe.
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Err(Failure::new(
                    1,
                    format!("the command's watchdog is gone ({e}); the command did not run"),
                ));
            }
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            return Err(Failure::new(
                code,
                format!("cannot run {}: {e}", program.to_string_lossy()),
            ));
        }
    };
    supervise(
        &pool,
        guard,
        (child, spawned_at),
        watchdog,
        name,
        (ttl, grace),
        &say,
    )
}

/// The checks the library makes of a lease name, a holder label and a ttl, made here so that
/// they come before connecting.
fn check_input(name: &str, holder: &str, ttl: Duration) -> Result<(), Failure> {
    let refuse = |message: String| Err(Failure::new(2, message));
    if name.is_empty() {
        return refuse("the lease name must not be empty".into());
    }
    if name.len() > tenure::MAX_NAME_BYTES {
        return refuse(format!(
            "the lease name is {} bytes long, the limit is {}",
            name.len(),
            tenure::MAX_NAME_BYTES
        ));
    }
    if holder.len() > tenure::MAX_LABEL_BYTES {
        return refuse(format!(
            "--holder is {} bytes long, the limit is {}",
            holder.len(),
            tenure::MAX_LABEL_BYTES
        ));
    }
    if ttl > tenure::MAX_TTL {
        return refuse(format!(
            "--ttl {ttl:?} is longer than {} days",
            tenure::MAX_TTL.as_secs() / 86400
        ));
    }
    Ok(())
}

/// Takes the lease, waiting up to `wait` in line (first come, first served); a signal
/// meanwhile gives up (exit 128 + signal).
fn take(
    pool: &Pool,
    terms: &Take,
    wait: Duration,
    no_wait: bool,
    say: &dyn Fn(String),
) -> Result<LeaseGuard, Failure> {
    let name = terms.name();
    let gave_up = |signal: libc::c_int| {
        Failure::new(
            (128 + signal) as u8,
            format!(
                "{} while waiting for {name:?}: the command did not run",
                signal_name(signal)
            ),
        )
    };
    let mut taken = LeaseGuard::take_pooled_as(pool, terms);
    let busy = matches!(taken, Ok(None));
    if !no_wait && (busy || taken.as_ref().is_err_and(|e| e.is_retryable())) {
        if busy {
            say(format!("{name:?} is held; waiting up to {wait:?}"));
        }
        let in_line = Wait::up_to(wait)
            .poll_interval(Duration::from_millis(200))
            .cancel_when(signals_pending);
        taken = LeaseGuard::take_pooled_as(pool, &terms.clone().wait(in_line));
    }
    if let Some(&signal) = take_signals().first() {
        return Err(gave_up(signal));
    }
    match taken {
        Ok(Some(guard)) => return Ok(guard),
        Ok(None) => {}
        Err(e) => return Err(e.into()),
    }
    let who = match pool
        .get()
        .and_then(|mut c| tenure::lease::holders(&mut c, name))
    {
        Ok(holders) if holders.iter().any(|h| h.held) => holders
            .iter()
            .filter(|h| h.held)
            .map(|info| {
                format!(
                    "{:?} holds it (fence {}, expires in {})",
                    info.holder,
                    info.fence,
                    crate::output::age(info.expires_at - info.now)
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        _ => "someone holds it".into(),
    };
    let when = match no_wait {
        true => "--no-wait".to_string(),
        false => format!("waited {wait:?}"),
    };
    Err(Failure::new(
        HELD,
        format!("lease {name:?} is held: {who}; {when}, the command did not run"),
    ))
}

/// Why the command is being stopped.
enum Stop {
    Lost,
    Signal(libc::c_int),
}

/// Waits for the command while the guard renews, passing each renewal's deadline to the
/// watchdog; stops it when the lease is lost or a signal arrives; releases the lease once it
/// is gone.
fn supervise(
    pool: &Pool,
    guard: LeaseGuard,
    (mut child, spawned_at): (Child, Instant),
    mut watchdog: Watchdog,
    name: &str,
    (ttl, grace): (Duration, Duration),
    say: &dyn Fn(String),
) -> Outcome {
    let pgid = child.id() as i32;
    let fence = guard.fence();
    let mut stop: Option<(Stop, Instant)> = None;
    let mut killed = false;
    // Whether the watchdog still listens; if it died, this process stops the command alone.
    let mut watched = true;
    let mut tell = |sent: std::io::Result<()>| {
        if watched && let Err(e) = sent {
            watched = false;
            warn(&format!(
                "the command's watchdog is gone ({e}): if this process is stopped, nothing \
                 stops the command"
            ));
        }
        watched
    };
    // The longest this loop did not run, from the spawn on (a stop before the first tick,
    // under load, counts too): a paused process finds out here why it lost.
    let mut last_tick = spawned_at;
    let mut longest_gap = Duration::ZERO;
    let status = loop {
        // Measured first: a command the watchdog ended during a stop has exited by now.
        let now = Instant::now();
        longest_gap = longest_gap.max(now - last_tick);
        last_tick = now;
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(_) => {
                signal_group(pgid, libc::SIGKILL);
                break child.wait().ok();
            }
        }
        for signal in take_signals() {
            signal_group(pgid, signal);
            say(format!("forwarded {} to the command", signal_name(signal)));
            if stop.is_none() {
                stop = Some((Stop::Signal(signal), now + grace));
            }
        }
        let held_until = guard.held_until();
        if let Some(until) = held_until {
            tell(watchdog.hold_until(until));
        }
        let lost = held_until.is_none();
        if lost && !matches!(stop, Some((Stop::Lost, _))) {
            // The watchdog sends the SIGTERM, once, whether it saw the deadline pass itself
            // or is told now; this process only when the watchdog is gone.
            if !tell(watchdog.lost()) {
                signal_group(pgid, libc::SIGTERM);
            }
            // A lost lease shortens a grace already running for a forwarded signal, never
            // lengthens it.
            let kill_at = stop
                .as_ref()
                .map_or(now + grace, |(_, at)| (*at).min(now + grace));
            stop = Some((Stop::Lost, kill_at));
        }
        if let Some((_, kill_at)) = &stop
            && now >= *kill_at
            && !killed
        {
            signal_group(pgid, libc::SIGKILL);
            killed = true;
        }
        if lost {
            std::thread::sleep(Duration::from_millis(20));
        } else {
            // Wakes at once when the lease is lost.
            guard.wait_lost(Duration::from_millis(50));
        }
    };
    // What the command left running in its group goes too: the next holder must not run
    // beside it. The watchdog keeps hearing the deadlines meanwhile.
    if group_lives(pgid) {
        signal_group(pgid, libc::SIGTERM);
        let until = Instant::now() + grace;
        while group_lives(pgid) && Instant::now() < until {
            if let Some(held_until) = guard.held_until() {
                tell(watchdog.hold_until(held_until));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if group_lives(pgid) {
            signal_group(pgid, libc::SIGKILL);
        }
    }
    let report = watchdog.dismiss();
    killed |= report.killed;
    let exited = status.map_or("no exit status".into(), describe);
    // Held now means held throughout: loss is sticky.
    // Stopped by the watchdog at the deadline: not "held throughout" either (this process
    // may think the lease held, after a suspend its clock did not count).
    if matches!(stop, Some((Stop::Lost, _))) || !guard.is_held() || report.term_at_deadline {
        let how = match (&stop, killed) {
            _ if report.term_at_deadline => format!(
                "the watchdog sent the command SIGTERM at the lease's local deadline{} ({exited})",
                match killed {
                    true => format!(" and SIGKILL after the {grace:?} grace"),
                    false => String::new(),
                }
            ),
            (Some((Stop::Lost, _)), true) => format!(
                "the command got SIGTERM and was killed (SIGKILL) after the {grace:?} grace"
            ),
            (Some((Stop::Lost, _)), false) => {
                format!("the command got SIGTERM and stopped ({exited})")
            }
            _ => format!("the command had ended ({exited})"),
        };
        let why = why_lost(pool, name, fence, ttl, longest_gap);
        drop(guard);
        return Err(Failure::new(
            LOST,
            format!("lost the lease {name:?} (fence {fence}): {why}; {how}"),
        ));
    }
    match guard.release() {
        Ok(true) => say(format!("released {name:?} (fence {fence})")),
        Ok(false) => {
            // The token was gone at the release: force-released (or expired) after the last
            // renewal, so the command may have run beside the next holder. Not "held
            // throughout".
            let why = why_lost(pool, name, fence, ttl, longest_gap);
            return Err(Failure::new(
                LOST,
                format!(
                    "lost the lease {name:?} (fence {fence}): {why}; found at the release, \
                     after the command had ended ({exited})"
                ),
            ));
        }
        Err(e) => warn(&format!(
            "could not release {name:?} ({e}); it expires within {ttl:?}"
        )),
    }
    let code = status.map_or(1, status_code);
    if let Some((Stop::Signal(signal), _)) = stop {
        warn(&format!(
            "{} forwarded to the command; it ended ({exited}){}",
            signal_name(signal),
            if killed {
                format!(" after SIGKILL at the end of the {grace:?} grace")
            } else {
                String::new()
            }
        ));
    }
    match code {
        0 => Ok(()),
        code => Err(Failure::new(code, String::new())),
    }
}

/// Why the lease was lost, as far as the database and this process can tell.
fn why_lost(pool: &Pool, name: &str, fence: i64, ttl: Duration, gap: Duration) -> String {
    let paused = if gap > ttl / 3 {
        format!("this process did not run for {gap:.1?} (stopped, e.g. SIGSTOP, or starved) and ")
    } else {
        String::new()
    };
    // Asked on another thread: on a partitioned network the query can hang for hours.
    let (tell, answer) = std::sync::mpsc::channel();
    let (asker_pool, asker_name) = (pool.clone(), name.to_string());
    std::thread::spawn(move || {
        let info = asker_pool
            .get()
            .and_then(|mut c| tenure::lease::inspect(&mut c, &asker_name));
        let _ = tell.send(info);
    });
    let Ok(info) = answer.recv_timeout(WHY_WAIT) else {
        return format!(
            "{paused}renewals did not succeed before its local deadline, and the database \
             does not answer now"
        );
    };
    let now = match info {
        Ok(Some(info)) if info.fence > fence => format!(
            "it was force-released (`tenure leases release --force`) or expired, and {:?} took \
             it since (fence {}{})",
            info.holder,
            info.fence,
            if info.held { ", holding it now" } else { "" }
        ),
        Ok(Some(info)) if info.held => {
            "renewals did not succeed before its local deadline (the database was slow or \
             unreachable)"
                .into()
        }
        Ok(Some(_)) => "it was force-released (`tenure leases release --force`) or expired \
                        before a renewal reached the database"
            .into(),
        Ok(None) => "its row was deleted".into(),
        Err(e) => format!("renewals failed, and the database cannot be reached now ({e})"),
    };
    format!("{paused}{now}")
}

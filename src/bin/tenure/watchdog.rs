//! The watchdog of a command that `tenure work` or `tenure lease run` starts: this binary run
//! again (`tenure __watchdog GRACE_MS`, hidden from --help), in a process group of its own,
//! which ends the command's process group when the process that started it cannot:
//!
//! - that process died, however (SIGKILL included): its pipe reads end-of-file, and the group
//!   gets SIGKILL at once, before the job can run again or the lease be taken beside it;
//! - the lease the command runs under is not surely held any more and no newer word came (that
//!   process is stopped, e.g. SIGSTOP, or starved): the group gets SIGTERM at the deadline and
//!   SIGKILL a grace later. A stopped process cannot stop its command; this one, which is not
//!   stopped with it, can.
//!
//! It reads lines on stdin: `group PGID` (the group to watch), `until NS` (the lease is held
//! until NS on [`clock_ns`]'s clock: absolute, so a line that waited in the pipe while its
//! writer was stopped is still right), `lost` (SIGTERM now, SIGKILL after the grace), `done`
//! (leave; the exit status says what it did, see [`Report`]).

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// Exit status bits of a dismissed watchdog that signalled the group ([`Report`]).
const SIGNALLED: i32 = 16;
const TERM_AT_DEADLINE: i32 = 1;
const TERM_ON_LOST: i32 = 2;
const KILLED: i32 = 4;

/// Nanoseconds on the clock the watchdog keeps its deadlines by: on Linux CLOCK_BOOTTIME,
/// which goes on while the machine is suspended, as the database's clock does.
fn clock_ns() -> u64 {
    #[cfg(target_os = "linux")]
    const CLOCK: libc::clockid_t = libc::CLOCK_BOOTTIME;
    #[cfg(not(target_os = "linux"))]
    const CLOCK: libc::clockid_t = libc::CLOCK_MONOTONIC;
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given; both clocks always exist.
    unsafe { libc::clock_gettime(CLOCK, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// `at` on [`clock_ns`]'s clock. The clock is read first: a pause before `Instant::now()`
/// only makes the result earlier, never later.
fn clock_ns_at(at: Instant) -> u64 {
    let clock = clock_ns();
    clock + at.saturating_duration_since(Instant::now()).as_nanos() as u64
}

/// What a dismissed watchdog did.
#[derive(Default)]
pub struct Report {
    /// SIGTERM at the deadline: no newer one came in time (its starter was stopped or starved).
    pub term_at_deadline: bool,
    /// SIGKILL after the grace.
    pub killed: bool,
}

/// How long a dismissed (or dropped) watchdog may take to exit before it is killed: a
/// watchdog that was stopped itself must not hang the process that started it.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// The starting process's end of a watchdog.
pub struct Watchdog {
    child: Child,
    pipe: Option<ChildStdin>,
    /// The group watched, which dropping the watchdog kills.
    group: Option<u32>,
    /// The last deadline sent, so that each is sent once.
    until: Option<Instant>,
}

impl Watchdog {
    /// Starts a watchdog that waits `grace` between SIGTERM and SIGKILL. It watches nothing
    /// until [`Watchdog::spawn`] starts the command.
    pub fn start(grace: Duration) -> std::io::Result<Watchdog> {
        // This binary: /proc/self/exe is it even when its file was replaced since (an upgrade).
        #[cfg(target_os = "linux")]
        let program = std::path::PathBuf::from("/proc/self/exe");
        #[cfg(not(target_os = "linux"))]
        let program = std::env::current_exe()?;
        let mut command = Command::new(program);
        command
            .args(["__watchdog", &grace.as_millis().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own group: a signal to the command's group (or a terminal's Ctrl-C or Ctrl-Z
            // to tenure's) does not reach it.
            .process_group(0);
        // No database connection of this process reaches it.
        crate::children::inherit_only_stdio(&mut command);
        let mut child = command.spawn()?;
        let pipe = child.stdin.take();
        if let Some(pipe) = &pipe {
            // Never block on a watchdog that does not read (it was stopped): a line either
            // fits in the pipe whole (it is shorter than PIPE_BUF) or waits for the next try.
            let fd = pipe.as_raw_fd();
            // SAFETY: fcntl on a descriptor this process owns.
            unsafe {
                let flags = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Ok(Watchdog {
            child,
            pipe,
            group: None,
            until: None,
        })
    }

    /// Spawns `command` (which must start a process group of its own) and watches its group,
    /// held until `until` if it runs under a lease. The command's own process tells this
    /// watchdog its group (and `until`) between fork and exec, so that it never runs
    /// unwatched: were that left to this process after `spawn` returned, a SIGKILL (or a
    /// SIGSTOP) landing in between would leave what the command starts running beside the
    /// job's next run (seen once under load: a `sleep` child outlived its killed worker).
    pub fn spawn(
        &mut self,
        command: &mut Command,
        until: Option<Instant>,
    ) -> std::io::Result<Child> {
        let fd = match &self.pipe {
            Some(pipe) => pipe.as_raw_fd(),
            None => return Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        // Made here: between fork and exec only async-signal-safe calls, no allocation.
        let until_line = until
            .map(|until| format!("until {}\n", clock_ns_at(until)))
            .unwrap_or_default()
            .into_bytes();
        // SAFETY: getpid, signal and write are async-signal-safe; the buffer is on the stack.
        unsafe {
            command.pre_exec(move || {
                let mut line = [0u8; 96];
                let mut len = announce_group(&mut line, libc::getpid());
                let tail = until_line.len().min(line.len() - len);
                line[len..len + tail].copy_from_slice(&until_line[..tail]);
                len += tail;
                // A watchdog that is gone must fail this spawn, not kill the child with
                // SIGPIPE (which std would take for a successful exec).
                libc::signal(libc::SIGPIPE, libc::SIG_IGN);
                let written = libc::write(fd, line.as_ptr().cast(), len);
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                if written == len as isize {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        match command.spawn() {
            Ok(child) => {
                self.group = Some(child.id());
                self.until = until;
                Ok(child)
            }
            Err(e) => {
                // The child may have announced itself before its exec failed: forget it.
                let _ = self.send("group 0\n");
                Err(e)
            }
        }
    }

    /// The lease is held until `until` (sent only when it moved; when the pipe is full, at
    /// the next call).
    pub fn hold_until(&mut self, until: Instant) -> std::io::Result<()> {
        if self.until == Some(until) {
            return Ok(());
        }
        match self.send(&format!("until {}\n", clock_ns_at(until))) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            sent => {
                self.until = Some(until);
                sent
            }
        }
    }

    /// The lease is lost: SIGTERM to the group now (unless already sent), SIGKILL after the
    /// grace.
    pub fn lost(&mut self) -> std::io::Result<()> {
        self.send("lost\n")
    }

    /// One line in one write: whole or not at all.
    fn send(&mut self, text: &str) -> std::io::Result<()> {
        let Some(pipe) = self.pipe.as_mut() else {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        };
        match pipe.write(text.as_bytes())? {
            n if n == text.len() => Ok(()),
            _ => Err(std::io::Error::other("a line was cut")),
        }
    }

    /// Closes the pipe and waits for the watchdog's exit status, at most [`EXIT_WAIT`]; a
    /// watchdog that did not exit by then is killed (and said nothing).
    fn finish(&mut self) -> Option<i32> {
        drop(self.pipe.take());
        let until = Instant::now() + EXIT_WAIT;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.code(),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(1)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return None;
                }
            }
        }
    }

    /// The run is over: the watchdog leaves without signalling anything more, and says what it
    /// did.
    pub fn dismiss(mut self) -> Report {
        self.group = None;
        let _ = self.send("done\n");
        let code = self.finish().unwrap_or(0);
        if code & SIGNALLED == 0 {
            return Report::default();
        }
        Report {
            term_at_deadline: code & TERM_AT_DEADLINE != 0,
            killed: code & KILLED != 0,
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Not dismissed (an early return, a panic): the group goes, as at this process's
        // death. Closing the pipe makes the watchdog kill it; so does this, in case the
        // watchdog cannot.
        if let Some(group) = self.group.take() {
            crate::children::kill_group(group);
        }
        self.finish();
    }
}

/// Writes `group PID\n` into `line`, returning its length: digits by hand, as between fork
/// and exec nothing may allocate.
fn announce_group(line: &mut [u8; 96], pid: libc::pid_t) -> usize {
    let prefix = b"group ";
    line[..prefix.len()].copy_from_slice(prefix);
    let mut digits = [0u8; 20];
    let (mut n, mut count) = (pid.unsigned_abs(), 0);
    loop {
        digits[count] = b'0' + (n % 10) as u8;
        count += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut len = prefix.len();
    for digit in digits[..count].iter().rev() {
        line[len] = *digit;
        len += 1;
    }
    line[len] = b'\n';
    len + 1
}

/// `tenure __watchdog GRACE_MS`: the watchdog itself. Returns its exit status.
pub fn serve(grace_ms: u64) -> u8 {
    let grace = grace_ms.saturating_mul(1_000_000);
    let mut group: Option<i32> = None;
    let mut until: Option<u64> = None;
    let mut kill_at: Option<u64> = None;
    // What it sent, as the exit status's bits.
    let mut sent = 0;
    let signal = |group: Option<i32>, signal| {
        if let Some(pgid) = group {
            // SAFETY: kill(2) with a negative pid names a process group.
            unsafe { libc::kill(-pgid, signal) };
        }
    };
    // As large as a pipe holds: one read takes every line waiting, so a deadline is judged
    // by the newest one, never by an old line read ahead of it.
    let mut buffer = vec![0u8; 1 << 16];
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let now = clock_ns();
        let termed = sent & (TERM_AT_DEADLINE | TERM_ON_LOST) != 0;
        if let (false, Some(_), Some(at)) = (termed, group, until)
            && now >= at
        {
            signal(group, libc::SIGTERM);
            sent |= TERM_AT_DEADLINE;
            kill_at = Some(at.saturating_add(grace));
        }
        if let Some(at) = kill_at
            && now >= at
            && sent & KILLED == 0
        {
            signal(group, libc::SIGKILL);
            sent |= KILLED;
        }
        let wake = match (sent & (TERM_AT_DEADLINE | TERM_ON_LOST), sent & KILLED) {
            (0, _) => group.and(until),
            (_, 0) => kill_at,
            _ => None,
        };
        // Rounded up: waking a little early would only loop. At most a second: poll's timeout
        // stands still while the machine is suspended, the boot clock does not.
        let timeout = wake.map_or(-1, |at| {
            at.saturating_sub(now).div_ceil(1_000_000).min(1000) as libc::c_int
        });
        let mut poll = libc::pollfd {
            fd: 0,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call.
        if unsafe { libc::poll(&mut poll, 1, timeout) } <= 0 {
            continue; // timed out, or a signal interrupted it
        }
        // SAFETY: reads into a buffer of its length.
        let n = unsafe { libc::read(0, buffer.as_mut_ptr().cast(), buffer.len()) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            // The starting process is gone: so must its command be.
            signal(group, libc::SIGKILL);
            return 1;
        }
        pending.extend_from_slice(&buffer[..n as usize]);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let mut words = line.split_whitespace();
            let (word, number) = (words.next(), words.next().and_then(|w| w.parse().ok()));
            match (word, number) {
                (Some("group"), Some(pgid)) => {
                    group = i32::try_from(pgid).ok().filter(|&g| g > 0);
                }
                (Some("until"), Some(at)) => until = Some(at),
                (Some("lost"), _) if sent & (TERM_AT_DEADLINE | TERM_ON_LOST) == 0 => {
                    signal(group, libc::SIGTERM);
                    sent |= TERM_ON_LOST;
                    kill_at = Some(clock_ns().saturating_add(grace));
                }
                (Some("done"), _) => {
                    return match sent {
                        0 => 0,
                        bits => (SIGNALLED | bits) as u8,
                    };
                }
                _ => {}
            }
        }
    }
}

//! What `tenure work` and `tenure lease run` promise about the commands they start: a command
//! inherits no descriptor of theirs (a database connection inherited would keep its session,
//! and a worker's liveness lock, alive after the worker died), and a command's whole process
//! group ends when the process that started it dies, even by SIGKILL, which no handler sees.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};

/// Makes `command` start with only its standard streams: every other descriptor is marked
/// close-on-exec between fork and exec.
pub fn inherit_only_stdio(command: &mut Command) {
    // SAFETY: only async-signal-safe system calls between fork and exec.
    unsafe {
        command.pre_exec(|| {
            mark_close_on_exec_from(3);
            Ok(())
        });
    }
}

/// Every descriptor from `first` up marked close-on-exec (std's own exec-error pipe already
/// is one). `close_range(CLOSE_RANGE_CLOEXEC)` where the kernel has it (5.11+), else one
/// `fcntl` per possible descriptor.
fn mark_close_on_exec_from(first: libc::c_int) {
    #[cfg(target_os = "linux")]
    {
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
        // SAFETY: a system call on descriptor numbers.
        let done = unsafe {
            libc::syscall(
                libc::SYS_close_range,
                first as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            )
        };
        if done == 0 {
            return;
        }
    }
    // SAFETY: sysconf and fcntl on descriptor numbers; closed ones fail with EBADF.
    unsafe {
        let most = libc::sysconf(libc::_SC_OPEN_MAX).clamp(256, 65_536) as libc::c_int;
        for fd in first..most {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// A process that kills process group `pgid` when this process dies: a shell reading a pipe
/// whose only writer is this process. At this process's death (however it dies) the pipe
/// reads end-of-file and the watchdog kills the group; [`GroupWatchdog::dismiss`] (the run
/// ended, the group is already dealt with) tells it to leave quietly.
pub struct GroupWatchdog {
    child: Child,
    pipe: Option<ChildStdin>,
}

/// The watchdog's script: `$1` is the group (`kill -s KILL --`: dash takes `kill -KILL --`
/// for a number). `read` fails at end-of-file; a line `done` dismisses it.
const WATCHDOG: &str =
    r#"read -r line; [ "$line" = done ] || kill -s KILL -- "-$1" 2>/dev/null; exit 0"#;

impl GroupWatchdog {
    pub fn start(pgid: u32) -> std::io::Result<GroupWatchdog> {
        let mut command = Command::new("/bin/sh");
        command
            .args(["-c", WATCHDOG, "tenure-watchdog", &pgid.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own group: killing the command's group does not kill it, and a terminal's
            // Ctrl-C does not either.
            .process_group(0);
        inherit_only_stdio(&mut command);
        let mut child = command.spawn()?;
        let pipe = child.stdin.take();
        Ok(GroupWatchdog { child, pipe })
    }

    /// The run is over: the watchdog exits without killing anything.
    pub fn dismiss(mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = pipe.write_all(b"done\n");
        }
        let _ = self.child.wait();
    }
}

impl Drop for GroupWatchdog {
    fn drop(&mut self) {
        // Not dismissed (an early return): closing the pipe makes it kill the group.
        drop(self.pipe.take());
        let _ = self.child.wait();
    }
}

/// Sends SIGKILL to process group `pgid` (the command and what it started).
pub fn kill_group(pgid: u32) {
    // SAFETY: kill(2) with a negative pid names a process group.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), libc::SIGKILL);
    }
}

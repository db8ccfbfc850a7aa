//! What `tenure work` and `tenure lease run` promise about the commands they start: a command
//! inherits no descriptor of theirs (a database connection inherited would keep its session,
//! and a worker's liveness lock, alive after the worker died), and a command's whole process
//! group ends when the process that started it dies, even by SIGKILL, which no handler sees
//! (the watchdog, watchdog.rs, does that).

use std::os::unix::process::CommandExt;
use std::process::Command;

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

/// Sends SIGKILL to process group `pgid` (the command and what it started).
pub fn kill_group(pgid: u32) {
    // SAFETY: kill(2) with a negative pid names a process group.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), libc::SIGKILL);
    }
}

/// Sends `signal` to every process of the group `pgid`; false if there is none left.
pub fn signal_group(pgid: i32, signal: libc::c_int) -> bool {
    // SAFETY: plain system call; a negative pid names a process group.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

/// Whether a live process is left in the group `pgid`. Zombies do not count: one whose parent
/// died waits for init to reap it, which some containers' init does late.
pub fn group_lives(pgid: i32) -> bool {
    #[cfg(target_os = "linux")]
    if let Ok(dir) = std::fs::read_dir("/proc") {
        let pgid = pgid.to_string();
        return dir.flatten().any(|entry| {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                return false;
            };
            // pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let mut fields = rest.split_whitespace();
            let state = fields.next().unwrap_or("Z");
            let group = fields.nth(1).unwrap_or("");
            !matches!(state, "Z" | "X") && group == pgid
        });
    }
    signal_group(pgid, 0)
}

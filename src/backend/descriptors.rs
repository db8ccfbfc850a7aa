//! The MariaDB/MySQL client opens its sockets without close-on-exec, so every process a
//! program starts (a shell job's command, say) would inherit the connection, and with it the
//! session: a worker's liveness lock (`GET_LOCK`) would outlive the worker as long as any
//! child it started lives. Descriptors the client opens while connecting are marked
//! close-on-exec here. libpq and SQLite open theirs close-on-exec already.

use std::collections::BTreeSet;

/// The descriptors open in this process now (Linux: `/proc/self/fd`; elsewhere none known).
pub(crate) fn open_descriptors() -> BTreeSet<i32> {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return BTreeSet::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Marks close-on-exec every descriptor open now that was not in `before`. Another thread's
/// descriptor opened meanwhile may be marked too, which only keeps it out of children (what
/// Rust's standard library does for every descriptor it opens).
pub(crate) fn close_on_exec_since(before: &BTreeSet<i32>) {
    for fd in open_descriptors().difference(before) {
        // SAFETY: fcntl on a descriptor number; a closed one fails with EBADF, harmlessly.
        unsafe {
            let flags = libc::fcntl(*fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(*fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

//! `tenure lease run` and signals: SIGINT and SIGTERM sent to the runner reach the command,
//! the runner exits with its status and the lease is free; a command ignoring the signal is
//! killed after the grace; a signal while waiting gives up without running the command.
//!
//! Timing bounds are wide (a loaded machine): each bounds a latency far above what it should
//! be, never measures it tightly.

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::lease_run::{LONG, Runner, group_alive, lease_state, read, read_number, wait_until};

conformance!(lease_run_forwards_signals_and_releases,);

/// SIGINT and SIGTERM sent to the runner reach the command (in its own process group, a
/// terminal's Ctrl-C would reach only tenure); the runner exits with the command's status and
/// the lease is free right after. A command ignoring the signal is killed after the grace.
/// A signal while waiting gives up without running the command.
fn lease_run_forwards_signals_and_releases(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    // SIGINT, trapped by the command: its own status.
    let mut runner = Runner::start(
        url,
        d,
        "int",
        &[
            "ctl",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "trap 'echo int >> \"$DIR/int.log\"; exit 3' INT; echo $$ > \"$DIR/int.pid\"; \
           while :; do sleep 0.1; done",
        ],
    );
    let pgid = read_number(&d.join("int.pid"));
    runner.signal("INT");
    assert_eq!(runner.exit(LONG).code(), Some(3), "{}", runner.stderr());
    assert!(read(&d.join("int.log")).contains("int"));
    assert!(!lease_state(url, "ctl").0, "the lease is free right after");
    assert!(!group_alive(pgid));

    // SIGTERM, not trapped: the command dies of it, 128 + 15.
    let mut runner = Runner::start(
        url,
        d,
        "term",
        &[
            "ctl",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$DIR/term.pid\"; exec sleep 120",
        ],
    );
    let pgid = read_number(&d.join("term.pid"));
    runner.signal("TERM");
    assert_eq!(runner.exit(LONG).code(), Some(143), "{}", runner.stderr());
    assert!(!lease_state(url, "ctl").0);
    assert!(!group_alive(pgid));

    // A command that ignores SIGINT: SIGKILL after the grace, 128 + 9.
    let mut runner = Runner::start(
        url,
        d,
        "ignore",
        &[
            "ctl",
            "--ttl",
            "3s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            "trap '' INT; echo $$ > \"$DIR/ignore.pid\"; while :; do sleep 0.1; done",
        ],
    );
    let pgid = read_number(&d.join("ignore.pid"));
    runner.signal("INT");
    assert_eq!(runner.exit(LONG).code(), Some(137), "{}", runner.stderr());
    assert!(runner.stderr().contains("SIGKILL"), "{}", runner.stderr());
    assert!(!lease_state(url, "ctl").0);
    assert!(!group_alive(pgid));

    // Ctrl-C while waiting: 130, the command never ran, the holder is undisturbed.
    let mut holder = Runner::start(
        url,
        d,
        "holder",
        &[
            "ctl",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/holder.fence\"; while [ ! -e \"$DIR/stop\" ]; do sleep 0.05; done",
        ],
    );
    let fence = read_number(&d.join("holder.fence"));
    let mut waiter = Runner::start(
        url,
        d,
        "waiter",
        &[
            "ctl",
            "--wait",
            "120s",
            "-v",
            "--",
            "sh",
            "-c",
            "touch \"$DIR/waiter-ran\"",
        ],
    );
    wait_until(LONG, "the waiter waits", || {
        waiter.stderr().contains("waiting")
    });
    waiter.signal("INT");
    assert_eq!(waiter.exit(LONG).code(), Some(130), "{}", waiter.stderr());
    assert!(!d.join("waiter-ran").exists());
    assert_eq!(lease_state(url, "ctl"), (true, fence));
    std::fs::write(d.join("stop"), "").unwrap();
    assert_eq!(holder.exit(LONG).code(), Some(0), "{}", holder.stderr());
    assert!(!lease_state(url, "ctl").0);
}

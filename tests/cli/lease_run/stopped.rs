//! `tenure lease run` with its supervisor stopped (SIGSTOP): the command must stop on its own
//! at the lease's deadline, not run beside the next holder for as long as the stop lasts.
//!
//! The commands time themselves: each appends `/proc/uptime` (the kernel's boot clock, one for
//! both, read without a fork) to a file every 50 ms. The test compares only those stamps,
//! never its own clock. Bounds are wide: each is seconds above what it should be.

use std::path::Path;
use std::time::Duration;

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::lease_run::{LONG, Runner, group_alive, read, read_number, wait_until};

conformance!(lease_run_stopped_supervisor_stops_its_command_at_the_deadline);

/// The watchdog is `tenure __watchdog`, which tenure runs itself: not in the help.
#[test]
fn lease_run_watchdog_subcommand_is_hidden() {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_tenure"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(!String::from_utf8_lossy(&help.stdout).contains("watchdog"));
}

/// A command that beats into `$DIR/beats` as `TAG UPTIME` every 50 ms until `$DIR/TAG.stop`
/// exists, notes a SIGTERM (`TAG-term UPTIME`) and goes on: the worst case, which only SIGKILL
/// stops. It records its pid and what tenure gave it in its environment.
fn beating(tag: &str) -> String {
    format!(
        "trap 'read up _ < /proc/uptime; echo \"{tag}-term $up\" >> \"$DIR/beats\"' TERM; \
         echo \"$TENURE_LEASE_TTL $TENURE_LEASE_GRACE\" > \"$DIR/{tag}.env\"; \
         echo $$ > \"$DIR/{tag}.pid\"; \
         while [ ! -e \"$DIR/{tag}.stop\" ]; do \
           read up _ < /proc/uptime; echo \"{tag} $up\" >> \"$DIR/beats\"; sleep 0.05; \
         done"
    )
}

/// The stamps of the lines of `$DIR/beats` whose first word is `tag`.
fn stamps(dir: &Path, tag: &str) -> Vec<f64> {
    read(&dir.join("beats"))
        .lines()
        .filter_map(|line| line.split_once(' '))
        .filter(|(t, _)| *t == tag)
        .filter_map(|(_, stamp)| stamp.trim().parse().ok())
        .collect()
}

/// Was a defect (issue 32, item 7), found by this attack and fixed: `tenure lease run`
/// alone is SIGSTOPped for 7 s (--ttl 2s, --grace 1s). A stopped supervisor cannot stop its
/// command, which kept running; the lease expired, a second `tenure lease run` took it, and the
/// two commands ran together for about 5 s, far past the 1 s grace. Fix: a watchdog process,
/// not stopped with the supervisor, is told after every renewal how long the lease is surely
/// held; when no newer word comes in time it sends the command's group SIGTERM at that
/// deadline and SIGKILL a grace later. After SIGCONT the first runner exits 76.
fn lease_run_stopped_supervisor_stops_its_command_at_the_deadline(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let grace = 1.0;
    let start = |tag: &str| {
        let script = beating(tag);
        let args = [
            "stopped", "--ttl", "2s", "--grace", "1s", "--wait", "120s", "--", "sh", "-c", &script,
        ];
        Runner::start(url, d, tag, &args)
    };
    let mut a = start("a");
    let a_pgid = read_number(&d.join("a.pid"));
    wait_until(LONG, "the first command beats", || {
        stamps(d, "a").len() >= 2
    });
    a.signal("STOP");
    let mut b = start("b");
    // The stop of the issue: 7 s, three and a half ttls.
    std::thread::sleep(Duration::from_secs(7));
    wait_until(LONG, "the second runner takes the lease", || {
        !stamps(d, "b").is_empty()
    });
    a.signal("CONT");
    let a_status = a.exit(LONG);
    std::fs::write(d.join("b.stop"), "").unwrap();
    let b_status = b.exit(LONG);

    let (a_beats, b_beats) = (stamps(d, "a"), stamps(d, "b"));
    let a_last = a_beats.iter().copied().fold(f64::MIN, f64::max);
    let b_first = b_beats.iter().copied().fold(f64::MAX, f64::min);
    let a_term = stamps(d, "a-term").first().copied();
    let overlap = (a_last - b_first).max(0.0);
    eprintln!(
        "{backend:?}: first command's last beat {:.2}s after its first, SIGTERM at {}, second \
         command's first beat {:.2}s after it; overlap {overlap:.2}s",
        a_last - a_beats[0],
        a_term.map_or("none".into(), |t| format!("{:.2}s", t - a_beats[0])),
        b_first - a_beats[0],
    );
    assert!(
        b_first > a_beats[0],
        "the second command started first: {:?}",
        read(&d.join("beats"))
    );
    assert!(
        overlap <= grace + 1.5,
        "the two commands ran together for {overlap:.2}s (grace {grace}s) while the first \
         runner was stopped: {}",
        a.stderr()
    );
    assert_eq!(a_status.code(), Some(76), "{}", a.stderr());
    assert!(
        a.stderr().contains("lost the lease") && a.stderr().contains("watchdog"),
        "{}",
        a.stderr()
    );
    assert!(
        !group_alive(a_pgid),
        "the first command outlived its runner"
    );
    assert_eq!(b_status.code(), Some(0), "{}", b.stderr());
    assert_eq!(
        read(&d.join("a.env")).trim(),
        "2 1",
        "TENURE_LEASE_TTL, _GRACE"
    );
}

//! `tenure lease run -n N`: N runs hold the lease together, the next one waits in line and
//! runs when one ends; `tenure leases show` lists every holder, `tenure leases watch` prints
//! who holds it.

use std::time::Duration;

use tenure::Backend;

use crate::common::{TestDb, conformance, count};
use crate::lease_run::{LONG, Runner, wait_until};
use crate::{json, tenure};

conformance!(lease_run_n_holders_run_together_and_the_next_waits_in_line);

/// Each command marks that it started (by its fence) and waits for a `go` file.
const SCRIPT: &str = "touch \"$DIR/started-$TENURE_LEASE_FENCE\"; \
                      while [ ! -e \"$DIR/go\" ]; do sleep 0.05; done";

fn started(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .expect("the directory")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("started-"))
        .count()
}

/// Two runs of `-n 2` hold "pool" at once; a third waits in line (it stands in
/// `tenure_lease_waiters`, its command not started) and runs once the others end. `show`
/// lists both holders; `watch --count 1` prints them and exits; `-n 0` is refused.
fn lease_run_n_holders_run_together_and_the_next_waits_in_line(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url().to_string();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let args = [
        "pool", "-n", "2", "--ttl", "30s", "--wait", "120s", "--", "sh", "-c", SCRIPT,
    ];
    let mut a = Runner::start(&url, d, "a", &args);
    let mut b = Runner::start(&url, d, "b", &args);
    wait_until(LONG, "two runs started", || started(d) == 2);
    let shown = json(&url, &["leases", "show", "pool"]);
    let held: Vec<_> = shown
        .as_array()
        .expect("a list")
        .iter()
        .filter(|h| h["held"] == true)
        .collect();
    assert_eq!(held.len(), 2, "{shown}");
    let watched = tenure(&url, &["leases", "watch", "pool", "--count", "1"]);
    assert!(watched.status.success());
    assert_eq!(
        String::from_utf8_lossy(&watched.stdout).lines().count(),
        2,
        "{watched:?}"
    );

    let mut c = Runner::start(&url, d, "c", &args);
    let mut conn = db.connect();
    wait_until(LONG, "the third run stands in line", || {
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_lease_waiters") == 1
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        started(d),
        2,
        "a third run started while two held the lease"
    );
    std::fs::write(d.join("go"), "").unwrap();
    for (tag, runner) in [("a", &mut a), ("b", &mut b), ("c", &mut c)] {
        let status = runner.exit(LONG);
        assert_eq!(status.code(), Some(0), "{tag}: {}", runner.stderr());
    }
    assert_eq!(started(d), 3);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_lease_waiters"),
        0
    );

    let refused = tenure(&url, &["lease", "run", "pool", "-n", "0", "--", "true"]);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
}

//! `tenure lease run`, end to end: real process trees (test → tenure → sh → sleep) on every
//! backend. Here: two runner loops never overlap, and the statuses of a held lease, of the
//! command and of bad input; the lease lost while the command runs and signals in files of
//! their own. Timing bounds are wide (a loaded machine): they bound latencies, never measure
//! them tightly.

mod arguments;
mod database;
mod holders;
mod lost;
mod processes;
mod signals;
mod stopped;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tenure::Backend;

use super::{json, tenure};
use crate::common::{TestDb, conformance};

conformance!(
    lease_run_two_runner_loops_never_overlap,
    lease_run_held_no_wait_statuses_and_bad_input,
);

/// Generous bound for anything that should take a second or two.
pub(super) const LONG: Duration = Duration::from_secs(60);

/// A `tenure lease run` process; killed (SIGKILL, and so its command, by PDEATHSIG) if the test
/// fails first.
pub(super) struct Runner {
    pub(super) child: Child,
    pub(super) stderr: PathBuf,
}

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Runner {
    pub(super) fn start(url: &str, dir: &Path, tag: &str, args: &[&str]) -> Runner {
        let stderr = dir.join(format!("{tag}.stderr"));
        let child = Command::new(env!("CARGO_BIN_EXE_tenure"))
            .arg("--database-url")
            .arg(url)
            .args(["lease", "run"])
            .args(args)
            .env_remove("TENURE_DATABASE_URL")
            .env_remove("DATABASE_URL")
            .env("DIR", dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start tenure lease run");
        Runner { child, stderr }
    }

    pub(super) fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub(super) fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for it to exit, at most `limit`.
    pub(super) fn exit(&mut self, limit: Duration) -> ExitStatus {
        crate::common::poll_until(limit, Duration::from_millis(20), || {
            self.child.try_wait().expect("try_wait")
        })
        .unwrap_or_else(|| {
            panic!(
                "tenure lease run did not exit within {limit:?}: {}",
                self.stderr()
            )
        })
    }

    pub(super) fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

pub(super) fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    crate::common::wait_until(what, limit, || done().then_some(()));
}

pub(super) fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub(super) fn read_number(path: &Path) -> i64 {
    wait_until(LONG, &format!("{} written", path.display()), || {
        read(path).ends_with('\n')
    });
    read(path).trim().parse().expect("a number")
}

/// Whether any live (not zombie) process is in the process group `pgid`.
pub(super) fn group_alive(pgid: i64) -> bool {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .any(|stat| {
            // pid (comm) state ppid pgrp ...: comm may hold spaces, so split after the ')'.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.len() > 3
                && fields[0] != "Z"
                && fields[0] != "X"
                && fields[2] == pgid.to_string()
        })
}

/// (held, fence) of the lease `name`, as `tenure leases list` says.
pub(super) fn lease_state(url: &str, name: &str) -> (bool, i64) {
    let list = json(url, &["leases", "list"]);
    let lease = list
        .as_array()
        .expect("a list")
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no lease {name} in {list}"));
    (
        lease["held"].as_bool().expect("held"),
        lease["fence"].as_i64().expect("fence"),
    )
}

/// Two loops of `tenure lease run` on the same name, started at once, 10 runs each: every run
/// succeeds (the one that finds the lease held waits), the commands' start/end lines never
/// interleave, and fences strictly increase. The lines are appended (O_APPEND) to one file, so
/// their order is the order the commands wrote them: no clock is compared.
fn lease_run_two_runner_loops_never_overlap(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url().to_string();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("turns.log");
    let script = "echo \"start $TENURE_LEASE_FENCE $(date +%s.%N)\" >> \"$DIR/turns.log\"; \
                  sleep 0.1; echo \"end $TENURE_LEASE_FENCE\" >> \"$DIR/turns.log\"";
    let barrier = std::sync::Barrier::new(2);
    let started = Instant::now();
    std::thread::scope(|s| {
        for loop_id in 0..2 {
            let (url, dir, barrier) = (&url, dir.path(), &barrier);
            s.spawn(move || {
                barrier.wait();
                for round in 0..10 {
                    let tag = format!("loop{loop_id}-{round}");
                    let mut runner = Runner::start(
                        url,
                        dir,
                        &tag,
                        &[
                            "turns", "--ttl", "3s", "--wait", "120s", "--", "sh", "-c", script,
                        ],
                    );
                    let status = runner.exit(Duration::from_secs(180));
                    assert_eq!(status.code(), Some(0), "{tag}: {}", runner.stderr());
                }
            });
        }
    });
    let lines: Vec<String> = read(&log).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 40, "{lines:#?}");
    let mut last_fence = 0;
    for pair in lines.chunks(2) {
        let start: Vec<&str> = pair[0].split_whitespace().collect();
        let end: Vec<&str> = pair[1].split_whitespace().collect();
        assert_eq!(start[0], "start", "overlap or lost line: {lines:#?}");
        assert_eq!(end, ["end", start[1]], "overlap: {lines:#?}");
        let fence: i64 = start[1].parse().unwrap();
        assert!(fence > last_fence, "fences must increase: {lines:#?}");
        last_fence = fence;
    }
    eprintln!(
        "{backend:?}: 20 runs from two loops in {:.1?}, fences up to {last_fence}",
        started.elapsed()
    );
    assert_eq!(lease_state(&url, "turns"), (false, last_fence));
}

/// `--no-wait` against a held lease exits 75 at once; `--wait` that runs out exits 75 too;
/// the command's own status passes through; a command that cannot start is 127; bad input is
/// 2. None of them leaves the lease held.
fn lease_run_held_no_wait_statuses_and_bad_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut holder = Runner::start(
        url,
        d,
        "holder",
        &[
            "--ttl",
            "3s",
            "nightly",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/holder.fence\"; while [ ! -e \"$DIR/stop\" ]; do sleep 0.05; done",
        ],
    );
    let fence = read_number(&d.join("holder.fence"));
    let mut no_wait = Runner::start(
        url,
        d,
        "no-wait",
        &[
            "nightly",
            "--no-wait",
            "--",
            "sh",
            "-c",
            "touch \"$DIR/ran\"",
        ],
    );
    assert_eq!(no_wait.exit(LONG).code(), Some(75), "{}", no_wait.stderr());
    assert!(no_wait.stderr().contains("is held"), "{}", no_wait.stderr());
    let mut short_wait = Runner::start(
        url,
        d,
        "short-wait",
        &[
            "nightly",
            "--wait",
            "1s",
            "--",
            "sh",
            "-c",
            "touch \"$DIR/ran\"",
        ],
    );
    assert_eq!(
        short_wait.exit(LONG).code(),
        Some(75),
        "{}",
        short_wait.stderr()
    );
    assert!(
        short_wait.stderr().contains("waited 1s"),
        "{}",
        short_wait.stderr()
    );
    assert!(
        !d.join("ran").exists(),
        "a runner that did not get the lease ran its command"
    );

    std::fs::write(d.join("stop"), "").unwrap();
    assert_eq!(holder.exit(LONG).code(), Some(0), "{}", holder.stderr());
    assert_eq!(lease_state(url, "nightly"), (false, fence));

    // The command's own status, and its environment.
    let mut seven = Runner::start(
        url,
        d,
        "seven",
        &[
            "nightly",
            "--no-wait",
            "--holder",
            "cron@host-b",
            "--",
            "sh",
            "-c",
            "echo \"$TENURE_LEASE_NAME $TENURE_LEASE_FENCE $TENURE_LEASE_TOKEN\" > \"$DIR/env\"; exit 7",
        ],
    );
    assert_eq!(seven.exit(LONG).code(), Some(7), "{}", seven.stderr());
    let env = read(&d.join("env"));
    let env: Vec<&str> = env.split_whitespace().collect();
    assert_eq!(env[0], "nightly");
    assert_eq!(env[1], (fence + 1).to_string());
    assert_eq!(env[2].len(), 36, "a UUID token: {env:?}");
    assert_eq!(lease_state(url, "nightly"), (false, fence + 1));
    let list = json(url, &["leases", "list"]);
    assert_eq!(list[0]["holder"], "cron@host-b");

    // Cannot start: 127 (not found), 126 (not executable); the lease is released.
    let mut missing = Runner::start(url, d, "missing", &["nightly", "--", "/no/such/command"]);
    assert_eq!(missing.exit(LONG).code(), Some(127), "{}", missing.stderr());
    let mut not_exec = Runner::start(url, d, "not-exec", &["nightly", "--", "/etc/passwd"]);
    assert_eq!(
        not_exec.exit(LONG).code(),
        Some(126),
        "{}",
        not_exec.stderr()
    );
    assert!(!lease_state(url, "nightly").0);

    // Bad input: usage status 2 and a message.
    for args in [
        &["", "--", "true"][..],
        &["nightly", "--ttl", "soon", "--", "true"],
        &["nightly", "--ttl", "0s", "--", "true"],
        &["nightly", "--wait", "forever", "--", "true"],
        &["nightly"],
        &["nightly", "--wait", "1s", "--no-wait", "--", "true"],
    ] {
        let mut all = vec!["lease", "run"];
        all.extend_from_slice(args);
        let out = tenure(url, &all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

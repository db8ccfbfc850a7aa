//! `tenure lease run`, end to end: real process trees (test → tenure → sh → sleep) on every
//! backend. Timing bounds are wide (a loaded machine): they bound latencies, never measure
//! them tightly.

mod arguments;
mod database;
mod processes;
mod stopped;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;
use tenure::Backend;

use super::{json, tenure};
use crate::common::{TestDb, conformance, now_sql};

conformance!(
    lease_run_two_runner_loops_never_overlap,
    lease_run_held_no_wait_statuses_and_bad_input,
    lease_run_force_release_stops_the_command_and_the_next_runner_takes_over,
    lease_run_paused_runner_stops_its_command_after_sigcont,
    lease_run_forwards_signals_and_releases
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
        let until = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < until,
                "tenure lease run did not exit within {limit:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// The fence check of the README, on this backend: change `reports` only while `fence` is
/// the lease's current fence (and never back to a lower fence).
fn fence_checked_update(conn: &mut tenure::AnyConnection, backend: Backend, fence: i64) -> usize {
    let sql = format!(
        "UPDATE reports SET body = 'written by {fence}', fence = {fence} \
         WHERE id = 1 AND fence <= {fence} \
         AND EXISTS (SELECT 1 FROM tenure_leases WHERE name = 'report' AND fence = {fence} \
                     AND token IS NOT NULL AND expires_at > {})",
        now_sql(backend)
    );
    diesel::sql_query(sql)
        .execute(conn)
        .expect("fence-checked update")
}

/// An operator force-releases the lease while the command runs: the command gets SIGTERM
/// within the ttl (it traps it and keeps going), is killed after the grace period, the runner
/// exits 76 saying why, and a waiting runner takes over with a higher fence. The README's
/// fence check then refuses the old fence and accepts the new one.
fn lease_run_force_release_stops_the_command_and_the_next_runner_takes_over(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut conn = db.connect();
    conn.batch_execute(
        "CREATE TABLE reports (id INTEGER PRIMARY KEY, body VARCHAR(100), fence BIGINT NOT NULL)",
    )
    .unwrap();
    conn.batch_execute("INSERT INTO reports (id, body, fence) VALUES (1, 'none', 0)")
        .unwrap();

    let ttl = Duration::from_secs(6);
    let mut first = Runner::start(
        url,
        d,
        "first",
        &[
            "report",
            "--ttl",
            "6s",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; trap 'echo term >> \"$DIR/a.log\"' TERM; \
           echo $$ > \"$DIR/a.pid\"; while :; do sleep 0.1; done",
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let a_fence = read_number(&d.join("a.fence"));
    assert_eq!(fence_checked_update(&mut conn, backend, a_fence), 1);
    let mut second = Runner::start(
        url,
        d,
        "second",
        &[
            "report",
            "--ttl",
            "6s",
            "--wait",
            "120s",
            "-v",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/b.fence\"; while [ ! -e \"$DIR/b.stop\" ]; do sleep 0.05; done",
        ],
    );
    wait_until(LONG, "the second runner waits", || {
        second.stderr().contains("waiting")
    });

    let released_at = Instant::now();
    super::ok(url, &["leases", "release", "report", "--force"]);
    wait_until(LONG, "the command gets SIGTERM", || {
        read(&d.join("a.log")).contains("term")
    });
    let term_after = released_at.elapsed();
    let status = first.exit(LONG);
    let gone_after = released_at.elapsed();
    eprintln!(
        "{backend:?}: force-release -> SIGTERM {term_after:.2?}, runner exited {gone_after:.2?}"
    );
    assert!(
        term_after < ttl,
        "SIGTERM took {term_after:?}, longer than the ttl"
    );
    assert_eq!(status.code(), Some(76), "{}", first.stderr());
    let message = first.stderr();
    assert!(
        message.contains("lost the lease") && message.contains("force-released"),
        "{message}"
    );
    assert!(
        message.contains("SIGKILL"),
        "it ignored SIGTERM, so SIGKILL: {message}"
    );
    assert!(
        !group_alive(pgid),
        "the command's group outlived its runner"
    );

    let b_fence = read_number(&d.join("b.fence"));
    assert!(b_fence > a_fence, "{b_fence} > {a_fence}");
    assert_eq!(lease_state(url, "report"), (true, b_fence));
    // The old fence changes nothing; the current one does.
    assert_eq!(fence_checked_update(&mut conn, backend, a_fence), 0);
    assert_eq!(fence_checked_update(&mut conn, backend, b_fence), 1);

    std::fs::write(d.join("b.stop"), "").unwrap();
    assert_eq!(second.exit(LONG).code(), Some(0), "{}", second.stderr());
    assert_eq!(lease_state(url, "report"), (false, b_fence));
    // After the release even the last fence is refused.
    assert_eq!(fence_checked_update(&mut conn, backend, b_fence), 0);
}

/// A runner stopped (SIGSTOP) past its ttl loses the lease to a second runner. Its watchdog,
/// not stopped with it, ends the command at the lease's deadline; after SIGCONT the runner
/// finds the lease lost and exits 76, while the new holder keeps the lease.
fn lease_run_paused_runner_stops_its_command_after_sigcont(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut paused = Runner::start(
        url,
        d,
        "paused",
        &[
            "sleepy",
            "--ttl",
            "3s",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; echo $$ > \"$DIR/a.pid\"; \
           while :; do sleep 0.1; done",
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let a_fence = read_number(&d.join("a.fence"));
    paused.signal("STOP");
    let mut next = Runner::start(
        url,
        d,
        "next",
        &[
            "sleepy",
            "--ttl",
            "3s",
            "--wait",
            "120s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/b.fence\"; while [ ! -e \"$DIR/b.stop\" ]; do sleep 0.05; done",
        ],
    );
    let b_fence = read_number(&d.join("b.fence"));
    assert!(b_fence > a_fence);
    // Only the runner was stopped; the command (SIGTERM not trapped) is gone all the same.
    wait_until(LONG, "the watchdog ends the command", || !group_alive(pgid));
    let resumed = Instant::now();
    paused.signal("CONT");
    let status = paused.exit(LONG);
    eprintln!(
        "{backend:?}: SIGCONT -> paused runner exited {:.2?}",
        resumed.elapsed()
    );
    assert_eq!(status.code(), Some(76), "{}", paused.stderr());
    let message = paused.stderr();
    assert!(message.contains("did not run for"), "{message}");
    assert!(!group_alive(pgid), "the paused runner's command still runs");
    // Its exit did not disturb the new holder.
    assert_eq!(lease_state(url, "sleepy"), (true, b_fence));
    std::fs::write(d.join("b.stop"), "").unwrap();
    assert_eq!(next.exit(LONG).code(), Some(0), "{}", next.stderr());
    assert_eq!(lease_state(url, "sleepy"), (false, b_fence));
}

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

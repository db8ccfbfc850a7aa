//! `tenure lease run`'s process tree: a SIGKILLed runner, children that escape, commands that
//! exit at once or misuse their output, signals at awkward moments, a broken stderr, and a
//! force-release before the command ends.
//!
//! Timing bounds are wide (a loaded machine): each bounds a latency far above what it should
//! be, never measures it tightly. Tests that found a defect say so in their doc comment.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::lease_run::{LONG, Runner, group_alive, lease_state, read, read_number, wait_until};
use crate::{json, tenure};

conformance!(
    lease_run_attack_sigkilled_runner_kills_its_command_and_the_lease_expires,
    lease_run_attack_escaping_children_do_not_hang_the_runner,
    lease_run_attack_twenty_quick_runs_release_every_time,
    lease_run_attack_closed_and_huge_output,
    lease_run_attack_signals_at_awkward_moments,
    lease_run_attack_force_release_before_the_command_ends_is_not_success,
    lease_run_attack_broken_stderr_keeps_the_documented_statuses,
);

/// A `tenure lease run` command line with the test's usual environment; stdio left to the
/// caller.
fn lease_run(url: &str, dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tenure"));
    command
        .arg("--database-url")
        .arg(url)
        .args(["lease", "run"])
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .env("DIR", dir)
        .stdin(Stdio::null());
    command
}

/// Wraps a child started by [`lease_run`] (so it is killed if the test fails first).
fn wrap(child: std::process::Child, dir: &Path, tag: &str) -> Runner {
    Runner {
        child,
        stderr: dir.join(format!("{tag}.no-stderr-file")),
    }
}

/// The lines of a file.
fn lines(path: &Path) -> Vec<String> {
    read(path).lines().map(str::to_string).collect()
}

/// SIGKILL to every process of the group `pgid` (cleanup of what a test left running).
fn kill_group(pgid: i64) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

/// The runner is SIGKILLed (it cannot catch that): its command's whole group dies with it
/// (the shell by PR_SET_PDEATHSIG, its child `sleep` by the watchdog, which the runner's death
/// wakes), and the lease is not held forever: a waiting runner takes it once it expired, with
/// a higher fence.
fn lease_run_attack_sigkilled_runner_kills_its_command_and_the_lease_expires(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut a = Runner::start(
        url,
        d,
        "a",
        &[
            "killed",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; sleep 120 & echo $$ > \"$DIR/a.pid\"; wait",
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let a_fence = read_number(&d.join("a.fence"));
    a.signal("KILL");
    a.exit(LONG);
    wait_until(LONG, "the command dies with its runner", || {
        !group_alive(pgid)
    });
    let mut b = Runner::start(
        url,
        d,
        "b",
        &[
            "killed",
            "--ttl",
            "3s",
            "--wait",
            "120s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/b.fence\"",
        ],
    );
    assert_eq!(b.exit(LONG).code(), Some(0), "{}", b.stderr());
    let b_fence = read_number(&d.join("b.fence"));
    assert!(b_fence > a_fence, "{b_fence} > {a_fence}");
    assert_eq!(lease_state(url, "killed"), (false, b_fence));
}

/// A command that leaves a double-forked child in its group, and one in a new session
/// (`setsid`, documented as escaping), then exits: the runner does not hang waiting for
/// either (stdout and stderr of the escapee are its own), stops the one left in its group,
/// exits with the command's status and releases the lease.
fn lease_run_attack_escaping_children_do_not_hang_the_runner(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let script = "setsid sh -c 'echo $$ > \"$DIR/escaped.pid\"; exec sleep 120' \
                  </dev/null >/dev/null 2>&1 & \
                  (sleep 120 & echo $! > \"$DIR/orphan.pid\"); \
                  while [ ! -s \"$DIR/escaped.pid\" ]; do sleep 0.05; done; \
                  echo $$ > \"$DIR/a.pid\"; exit 6";
    let started = Instant::now();
    let mut a = Runner::start(
        url,
        d,
        "a",
        &["escape", "--grace", "2s", "--", "sh", "-c", script],
    );
    let status = a.exit(LONG);
    let escaped = read_number(&d.join("escaped.pid"));
    let pgid = read_number(&d.join("a.pid"));
    eprintln!("{backend:?}: runner exited after {:.2?}", started.elapsed());
    assert_eq!(status.code(), Some(6), "{}", a.stderr());
    assert!(
        !group_alive(pgid),
        "the double-forked child outlived the run"
    );
    assert!(!lease_state(url, "escape").0);
    // The documented escape: still running, in a session of its own.
    let alive = Path::new(&format!("/proc/{escaped}")).exists();
    kill_group(escaped);
    assert!(
        alive,
        "the setsid child was expected to escape (documented)"
    );
}

/// 20 runs of a command that exits at once, one after another (50 took over nextest's minute
/// at load 20: three processes a run): each exits 0, leaves the
/// lease free, and takes the next fence.
fn lease_run_attack_twenty_quick_runs_release_every_time(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut last = 0;
    for round in 0..20 {
        let out = tenure(
            url,
            &[
                "lease",
                "run",
                "quick",
                "--no-wait",
                "--ttl",
                "2s",
                "--",
                "true",
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "round {round}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (held, fence) = lease_state(url, "quick");
        assert!(!held, "round {round}: the lease is still held");
        assert_eq!(fence, last + 1, "round {round}: fences go up by one");
        last = fence;
    }
}

/// A command that closes its stdin, stdout and stderr at once, and one that writes 20 MB:
/// the runner neither cares nor blocks (the command has the runner's own stdout), and
/// passes the status on.
fn lease_run_attack_closed_and_huge_output(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut closed = Runner::start(
        url,
        d,
        "closed",
        &[
            "out",
            "--",
            "sh",
            "-c",
            "exec <&- >&- 2>&-; sleep 0.2; exit 5",
        ],
    );
    assert_eq!(closed.exit(LONG).code(), Some(5), "{}", closed.stderr());

    const SIZE: usize = 20_000_000;
    let mut huge = lease_run(
        url,
        d,
        &["out", "--", "sh", "-c", "head -c 20000000 /dev/zero"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut stdout = huge.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut count = 0;
        let mut buffer = vec![0u8; 1 << 16];
        while let Ok(n) = stdout.read(&mut buffer) {
            if n == 0 {
                break;
            }
            count += n;
        }
        count
    });
    let mut huge = wrap(huge, d, "huge");
    assert_eq!(huge.exit(LONG).code(), Some(0));
    assert_eq!(reader.join().unwrap(), SIZE);
    assert!(!lease_state(url, "out").0);
}

/// A pipe whose buffer is full: writing to its write end blocks until the read end is read.
fn full_pipe() -> (File, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: plain system calls on fds this function owns.
    unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0);
        let (reader, writer) = (
            File::from(OwnedFd::from_raw_fd(fds[0])),
            OwnedFd::from_raw_fd(fds[1]),
        );
        let flags = libc::fcntl(writer.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(writer.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        let chunk = [b'x'; 4096];
        while libc::write(writer.as_raw_fd(), chunk.as_ptr().cast(), chunk.len()) > 0 {}
        libc::fcntl(writer.as_raw_fd(), libc::F_SETFL, flags);
        (reader, writer)
    }
}

/// Signals at awkward moments: SIGTERM after the lease was taken but before the command
/// started (tenure is blocked writing "took" to a full stderr pipe), two SIGINTs in a row to a
/// command that traps them, SIGHUP. Each: the command's status, the lease free, the group
/// gone.
fn lease_run_attack_signals_at_awkward_moments(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    // SIGTERM between the take and the start of the command.
    let (mut reader, writer) = full_pipe();
    let early = lease_run(
        url,
        d,
        &[
            "early",
            "-v",
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            // Written whole or not at all: the SIGTERM may end the shell between its
            // opening the file and writing the number (an empty early.pid, waited for in
            // vain for 60 s under load).
            "echo $$ > \"$DIR/early.tmp\" && mv \"$DIR/early.tmp\" \"$DIR/early.pid\"; exec sleep 120",
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::from(writer))
    .spawn()
    .unwrap();
    let mut early = wrap(early, d, "early");
    wait_until(LONG, "the lease is taken", || {
        json(url, &["leases", "list"])
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["name"] == "early" && l["held"] == true)
    });
    assert!(
        !d.join("early.pid").exists(),
        "the command started before the stderr pipe was drained"
    );
    early.signal("TERM");
    let drain = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = reader.read_to_end(&mut text);
        String::from_utf8_lossy(&text[text.len().saturating_sub(4096)..]).into_owned()
    });
    let status = early.exit(LONG);
    let said = drain.join().unwrap();
    assert_eq!(status.code(), Some(143), "{said}");
    assert!(!lease_state(url, "early").0, "{said}");
    if d.join("early.pid").exists() {
        assert!(!group_alive(read_number(&d.join("early.pid"))));
    }

    // Two SIGINTs: both reach the command, which exits after the second.
    let mut twice = Runner::start(
        url,
        d,
        "twice",
        &[
            "sig",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            ": > \"$DIR/ints\"; trap 'echo int >> \"$DIR/ints\"' INT; echo $$ > \"$DIR/twice.pid\"; \
             while [ $(wc -l < \"$DIR/ints\") -lt 2 ]; do sleep 0.05; done; exit 4",
        ],
    );
    let pgid = read_number(&d.join("twice.pid"));
    twice.signal("INT");
    wait_until(LONG, "the first SIGINT arrives", || {
        read(&d.join("ints")).lines().count() == 1
    });
    twice.signal("INT");
    assert_eq!(twice.exit(LONG).code(), Some(4), "{}", twice.stderr());
    assert!(!lease_state(url, "sig").0);
    assert!(!group_alive(pgid));

    // SIGHUP, not trapped: 128 + 1.
    let mut hup = Runner::start(
        url,
        d,
        "hup",
        &[
            "sig",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$DIR/hup.pid\"; exec sleep 120",
        ],
    );
    let pgid = read_number(&d.join("hup.pid"));
    hup.signal("HUP");
    assert_eq!(hup.exit(LONG).code(), Some(129), "{}", hup.stderr());
    assert!(!lease_state(url, "sig").0);
    assert!(!group_alive(pgid));
}

/// Was a defect, found by this attack and fixed: an operator force-releases the lease while a second runner waits for it; the
/// second takes it and starts its command at once; the first's command then ends before the
/// first runner's next renewal (ttl/3) would have noticed. The two commands overlapped, yet
/// the first runner exits 0, which the help defines as "it ran with the lease held
/// throughout". Cause: at the end `supervise` trusts the local `guard.is_held()` (which only
/// learns of a force-release at the next renewal) and ignores `guard.release()` returning
/// `Ok(false)` (the lease was no longer this runner's). Fix: when the release finds the
/// token gone (`Ok(false)`), report the loss like any other (exit 76, "it was
/// force-released or expired, and X took it since").
fn lease_run_attack_force_release_before_the_command_ends_is_not_success(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A ttl of 2 minutes: the first renewal (which would find out) comes after 40 s.
    let mut a = Runner::start(
        url,
        d,
        "a",
        &[
            "fr",
            "--ttl",
            "120s",
            "--",
            "sh",
            "-c",
            "echo start-a >> \"$DIR/turns.log\"; \
             while [ ! -e \"$DIR/b.started\" ]; do sleep 0.05; done; \
             echo end-a >> \"$DIR/turns.log\"",
        ],
    );
    wait_until(LONG, "the first command starts", || {
        read(&d.join("turns.log")).contains("start-a")
    });
    let mut b = Runner::start(
        url,
        d,
        "b",
        &[
            "fr",
            "--ttl",
            "120s",
            "--wait",
            "120s",
            "-v",
            "--",
            "sh",
            "-c",
            "echo start-b >> \"$DIR/turns.log\"; touch \"$DIR/b.started\"; \
             while [ ! -e \"$DIR/b.stop\" ]; do sleep 0.05; done; echo end-b >> \"$DIR/turns.log\"",
        ],
    );
    wait_until(LONG, "the second runner waits", || {
        b.stderr().contains("waiting")
    });
    crate::ok(url, &["leases", "release", "fr", "--force"]);
    let a_status = a.exit(LONG);
    std::fs::write(d.join("b.stop"), "").unwrap();
    assert_eq!(b.exit(LONG).code(), Some(0), "{}", b.stderr());
    let log = lines(&d.join("turns.log"));
    assert_eq!(log, ["start-a", "start-b", "end-a", "end-b"], "the setup");
    assert_eq!(
        a_status.code(),
        Some(76),
        "the first command ran beside the second, yet its runner reported success: {}",
        a.stderr()
    );
}

/// Was a defect, found by this attack and fixed: tenure's stderr is a pipe whose reader is gone (`tenure lease run ... 2>&1 | logger`
/// after logger died, a closed CI log). SIGPIPE is ignored (Rust's default), so writing a
/// message fails with EPIPE and `eprintln!` panics: exit 101, documented nowhere. With `-v`
/// the "took" line panics and the command never runs (the lease is released by unwinding);
/// `--no-wait` on a held lease gives 101, not 75; a lost lease gives 101, not 76; a forwarded
/// signal's report turns the command's 143 into 101. Fix: write tenure's messages with
/// `writeln!(std::io::stderr(), ...)` ignoring the error (a `say`/`warn` helper), and print
/// the final failure message the same way in `main`.
fn lease_run_attack_broken_stderr_keeps_the_documented_statuses(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let start = |tag: &str, args: &[&str]| {
        let mut child = lease_run(url, d, args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stderr.take()); // the reader is gone
        wrap(child, d, tag)
    };
    let mut wrong = Vec::new();

    // -v: the command runs and its status passes through.
    let mut verbose = start(
        "verbose",
        &[
            "pipe",
            "-v",
            "--",
            "sh",
            "-c",
            "touch \"$DIR/verbose.ran\"; exit 3",
        ],
    );
    let code = verbose.exit(LONG).code();
    if code != Some(3) || !d.join("verbose.ran").exists() {
        wrong.push(format!(
            "-v: {code:?}, command ran: {}",
            d.join("verbose.ran").exists()
        ));
    }

    // A holder, then --no-wait: 75.
    let mut holder = Runner::start(
        url,
        d,
        "holder",
        &[
            "pipe",
            "--ttl",
            "3s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$DIR/holder.pid\"; exec sleep 120",
        ],
    );
    read_number(&d.join("holder.pid"));
    let mut no_wait = start("no-wait", &["pipe", "--no-wait", "--", "true"]);
    let code = no_wait.exit(LONG).code();
    if code != Some(75) {
        wrong.push(format!("--no-wait on a held lease: {code:?}"));
    }
    holder.signal("TERM");
    assert_eq!(holder.exit(LONG).code(), Some(143), "{}", holder.stderr());

    // A forwarded SIGTERM: the command's 143.
    let mut term = start(
        "term",
        &[
            "pipe",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$DIR/term.pid\"; exec sleep 120",
        ],
    );
    let pgid = read_number(&d.join("term.pid"));
    term.signal("TERM");
    let code = term.exit(LONG).code();
    if code != Some(143) {
        wrong.push(format!("forwarded SIGTERM: {code:?}"));
    }
    kill_group(pgid);

    // A lost lease (force-release): 76.
    let mut lost = start(
        "lost",
        &[
            "pipe",
            "--ttl",
            "3s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$DIR/lost.pid\"; exec sleep 120",
        ],
    );
    let pgid = read_number(&d.join("lost.pid"));
    crate::ok(url, &["leases", "release", "pipe", "--force"]);
    let code = lost.exit(LONG).code();
    if code != Some(76) {
        wrong.push(format!("lost lease: {code:?}"));
    }
    kill_group(pgid);
    assert!(
        wrong.is_empty(),
        "with stderr a broken pipe, documented statuses changed (101 is a panic): {wrong:#?}"
    );
}

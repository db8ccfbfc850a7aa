//! Attacks on `tenure lease run`: a database that goes away or hangs, a runner killed, commands
//! that escape, exit at once or misuse their output, signals at awkward moments, hostile
//! arguments, and a force-release racing a waiting runner. Tests that found a defect say so in
//! their doc comment, with what broke and why.
//!
//! Timing bounds are wide (a loaded machine): each bounds a latency far above what it should
//! be, never measures it tightly.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;
use tenure::Backend;

use super::lease_run::{LONG, Runner, group_alive, lease_state, read, read_number, wait_until};
use super::{json, tenure};
use crate::common::{TestDb, conformance};

conformance!(
    lease_run_attack_renewal_blocked_by_a_row_lock_stops_the_command,
    lease_run_attack_sigkilled_runner_kills_its_command_and_the_lease_expires,
    lease_run_attack_escaping_children_do_not_hang_the_runner,
    lease_run_attack_fifty_quick_runs_release_every_time,
    lease_run_attack_closed_and_huge_output,
    lease_run_attack_signals_at_awkward_moments,
    lease_run_attack_hostile_arguments,
    lease_run_attack_bad_input_is_refused_before_touching_the_database,
    lease_run_attack_force_release_before_the_command_ends_is_not_success,
    lease_run_attack_broken_stderr_keeps_the_documented_statuses,
);

/// Instantiates tests that need a server (a TCP connection to cut, connections to kill) on
/// PostgreSQL and MariaDB.
macro_rules! on_servers {
    ($($test:ident),+ $(,)?) => {
        #[cfg(feature = "postgres")]
        mod postgres_server {
            $(#[test] fn $test() { super::$test(tenure::Backend::Postgres) })+
        }
        #[cfg(feature = "mysql")]
        mod mysql_server {
            $(#[test] fn $test() { super::$test(tenure::Backend::Mysql) })+
        }
    };
}

on_servers!(
    lease_run_attack_partition_stops_the_command_and_exits_76,
    lease_run_attack_partition_sigterm_while_connecting_ends_the_runner,
    lease_run_attack_killed_connections_are_replaced_and_the_lease_kept,
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

/// A TCP proxy to a database server that can be frozen: it then forwards nothing in either
/// direction but keeps every connection open, as a network partition does (no RST, no FIN:
/// the client's reads just never return). Thawed on drop.
struct Proxy {
    url: String,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    fn start(url: &str, backend: Backend) -> Proxy {
        let mut parsed = url::Url::parse(url).expect("a server URL");
        let port = parsed.port().unwrap_or(match backend {
            Backend::Postgres => 5432,
            _ => 3306,
        });
        let upstream = format!("{}:{port}", parsed.host_str().expect("a host"));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        parsed.set_host(Some("127.0.0.1")).unwrap();
        parsed
            .set_port(Some(listener.local_addr().unwrap().port()))
            .unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let flag = frozen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let pairs = [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ];
                for (from, to) in pairs {
                    let flag = flag.clone();
                    std::thread::spawn(move || pump(from, to, &flag));
                }
            }
        });
        Proxy {
            url: parsed.to_string(),
            frozen,
        }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.thaw();
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, frozen: &AtomicBool) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Frozen: hold what arrived (and everything after it) until thawed.
        while frozen.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// A command that writes its pid (its process group) and a start line, and on SIGTERM an
/// end line, then exits.
fn stoppable(tag: &str) -> String {
    format!(
        "echo $$ > \"$DIR/{tag}.pid\"; echo start-{tag} >> \"$DIR/turns.log\"; \
         trap 'echo end-{tag} >> \"$DIR/turns.log\"; exit 0' TERM; \
         while :; do sleep 0.1; done"
    )
}

/// Was a defect, found by this attack and fixed: the network to the database is cut (a partition: packets dropped, connections not
/// reset) while the command runs. The guard's local deadline fires and the command is
/// stopped in time (the waiting runner on an intact path takes over only after it ended),
/// but then the runner never exits: to say why it lost the lease, `why_lost` checks out a
/// pooled connection, and r2d2 tests an idle one with a query on the dead TCP connection,
/// which has no timeout and blocks until the network heals (TCP keepalive: hours). So no
/// exit 76 and no message; a cron job never finishes, and a supervisor waiting for it
/// (systemd, a CI step) waits with it.
fn lease_run_attack_partition_stops_the_command_and_exits_76(backend: Backend) {
    let db = TestDb::migrated(backend);
    let proxy = Proxy::start(db.url(), backend);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut a = Runner::start(
        &proxy.url,
        d,
        "a",
        &[
            "cut",
            "--ttl",
            "10s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            &stoppable("a"),
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let mut b = Runner::start(
        db.url(),
        d,
        "b",
        &[
            "cut",
            "--ttl",
            "10s",
            "--wait",
            "120s",
            "-v",
            "--",
            "sh",
            "-c",
            "echo start-b >> \"$DIR/turns.log\"; echo end-b >> \"$DIR/turns.log\"",
        ],
    );
    wait_until(LONG, "the second runner waits", || {
        b.stderr().contains("waiting")
    });

    proxy.freeze();
    let cut = Instant::now();
    wait_until(LONG, "the cut-off runner stops its command", || {
        !group_alive(pgid)
    });
    let stopped_after = cut.elapsed();
    assert_eq!(b.exit(LONG).code(), Some(0), "{}", b.stderr());
    assert_eq!(
        lines(&d.join("turns.log")),
        ["start-a", "end-a", "start-b", "end-b"],
        "the runners' commands overlapped"
    );
    eprintln!("{backend:?}: network cut -> command stopped after {stopped_after:.2?}");
    // The network is still cut: the runner must still finish, saying it lost the lease.
    let status = a.exit(LONG);
    let message = a.stderr();
    eprintln!(
        "{backend:?}: network cut -> runner exited after {:.2?}: {message}",
        cut.elapsed()
    );
    assert_eq!(status.code(), Some(76), "{message}");
    assert!(message.contains("lost the lease"), "{message}");
}

/// The database kills the runner's connections (an administrator, a failover, a restart)
/// several times while the command runs: the guard renews on fresh connections, so the
/// runner keeps the lease, its command runs on, and it exits with the command's status.
fn lease_run_attack_killed_connections_are_replaced_and_the_lease_kept(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut a = Runner::start(
        url,
        d,
        "a",
        &[
            "conns",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; \
             while [ ! -e \"$DIR/stop\" ]; do sleep 0.05; done; exit 9",
        ],
    );
    let fence = read_number(&d.join("a.fence"));
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pid: i64,
    }
    let others = match backend {
        Backend::Postgres => {
            "SELECT CAST(pid AS BIGINT) AS pid FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()"
        }
        _ => {
            "SELECT CAST(id AS SIGNED) AS pid FROM information_schema.processlist \
             WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        }
    };
    let mut admin = db.connect();
    let mut killed = 0;
    for round in 0..4 {
        // Kill whatever the runner has open once it has reconnected, then give it half the
        // ttl to renew on a fresh connection.
        let mut pids = Vec::new();
        wait_until(
            LONG,
            &format!("round {round}: the runner reconnects"),
            || {
                pids = diesel::sql_query(others).load::<Pid>(&mut admin).unwrap();
                !pids.is_empty()
            },
        );
        for Pid { pid } in &pids {
            let kill = match backend {
                Backend::Postgres => format!("SELECT pg_terminate_backend({pid})"),
                _ => format!("KILL {pid}"),
            };
            if admin.batch_execute(&kill).is_ok() {
                killed += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(1500));
    }
    assert!(killed >= 4, "killed only {killed} connections");
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the runner gave up: {}",
        a.stderr()
    );
    assert_eq!(lease_state(url, "conns"), (true, fence));
    std::fs::write(d.join("stop"), "").unwrap();
    assert_eq!(a.exit(LONG).code(), Some(9), "{}", a.stderr());
    assert_eq!(lease_state(url, "conns"), (false, fence));
}

/// The lease's row is locked by someone else's transaction far longer than the ttl, so a
/// renewal hangs (PostgreSQL: no lock timeout; MariaDB: 50 s; SQLite: the write lock, 5 s
/// busy timeouts over and over). The guard's local deadline still fires: the command is
/// stopped and the runner exits 76 while the lock is still held; the lease ends up free.
fn lease_run_attack_renewal_blocked_by_a_row_lock_stops_the_command(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut a = Runner::start(
        url,
        d,
        "a",
        &[
            "locked",
            "--ttl",
            "4s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            &stoppable("a"),
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let mut blocker = db.connect();
    match backend {
        Backend::Sqlite => blocker.batch_execute("BEGIN IMMEDIATE").unwrap(),
        _ => blocker
            .batch_execute("BEGIN; SELECT * FROM tenure_leases WHERE name = 'locked' FOR UPDATE")
            .unwrap(),
    }
    let locked = Instant::now();
    wait_until(LONG, "the command is stopped", || !group_alive(pgid));
    let stopped = locked.elapsed();
    let status = a.exit(LONG);
    let exited = locked.elapsed();
    eprintln!(
        "{backend:?}: row locked -> command stopped {stopped:.2?}, runner exited {exited:.2?}"
    );
    let message = a.stderr();
    assert_eq!(status.code(), Some(76), "{message}");
    assert!(message.contains("lost the lease"), "{message}");
    assert_eq!(lines(&d.join("turns.log")), ["start-a", "end-a"]);
    blocker.batch_execute("ROLLBACK").unwrap();
    wait_until(LONG, "the lease is free", || !lease_state(url, "locked").0);
}

/// The runner is SIGKILLed (it cannot catch that): its command (exec'd, so the runner's
/// direct child) dies with it (PR_SET_PDEATHSIG), and the lease is not held forever: a
/// waiting runner takes it once it expired, with a higher fence.
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
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; echo $$ > \"$DIR/a.pid\"; exec sleep 120",
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

/// 50 runs of a command that exits at once, one after another: each exits 0, leaves the
/// lease free, and takes the next fence.
fn lease_run_attack_fifty_quick_runs_release_every_time(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut last = 0;
    for round in 0..50 {
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
            "echo $$ > \"$DIR/early.pid\"; exec sleep 120",
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

/// Hostile arguments: names at and past the length limit, names with spaces, quotes and
/// non-ASCII, ttls out of range, a zero grace, a zero wait, a directory and an empty string
/// as the command, an over-long holder. Accepted ones work and pass the name through exactly;
/// refused ones exit 2 with a message and leave no lease behind.
fn lease_run_attack_hostile_arguments(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = |args: &[&str]| {
        let mut all = vec!["lease", "run"];
        all.extend_from_slice(args);
        tenure(url, &all)
    };
    let long = "n".repeat(255);
    let too_long = "n".repeat(256);
    let odd = "nightly report? it's \"ünïcødé\"; DROP TABLE x; -- *";
    let echo_name = "printf %s \"$TENURE_LEASE_NAME\" > \"$DIR/name\"";
    for name in [long.as_str(), odd] {
        let out = lease_run(url, d, &[name, "--", "sh", "-c", echo_name])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{name:?}: {out:?}");
        assert_eq!(read(&d.join("name")), name);
        assert!(!lease_state(url, name).0);
    }
    let holder = "h".repeat(256);
    for args in [
        &[too_long.as_str(), "--", "true"][..],
        &["ttl", "--ttl", "1ms", "--", "true"],
        &["ttl", "--ttl", "999ms", "--", "true"],
        &["ttl", "--ttl", "400d", "--", "true"],
        &["ttl", "--grace", "-1s", "--", "true"],
        &["ttl", "--holder", &holder, "--", "true"],
        &["ttl", "--"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
    assert_eq!(
        json(url, &["leases", "list"])
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["name"] == "ttl" || l["name"] == too_long.as_str())
            .count(),
        0,
        "refused runs left a lease row"
    );
    // The longest ttl is accepted (and released at the end, not left for a year).
    assert_eq!(
        run(&["ttl", "--ttl", "366d", "--", "true"]).status.code(),
        Some(0)
    );
    assert!(!lease_state(url, "ttl").0);

    // A directory, an empty string: cannot run (126, 127), the lease released.
    assert_eq!(run(&["cmd", "--", "/tmp"]).status.code(), Some(126));
    assert_eq!(run(&["cmd", "--", ""]).status.code(), Some(127));
    assert!(!lease_state(url, "cmd").0);

    // --wait 0s against a held lease: 75 at once; --grace 0s: SIGKILL right after a
    // forwarded signal.
    let mut holder = Runner::start(
        url,
        d,
        "holder",
        &[
            "held",
            "--grace",
            "0s",
            "--",
            "sh",
            "-c",
            "trap 'echo int >> \"$DIR/holder.log\"' INT; echo $$ > \"$DIR/holder.pid\"; \
             while :; do sleep 0.05; done",
        ],
    );
    let pgid = read_number(&d.join("holder.pid"));
    let out = run(&["held", "--wait", "0s", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    holder.signal("INT");
    assert_eq!(holder.exit(LONG).code(), Some(137), "{}", holder.stderr());
    assert!(!group_alive(pgid));
    assert!(!lease_state(url, "held").0);
}

/// Was a defect, found by this attack and fixed: bad arguments are checked only after connecting: the name's length, the holder's
/// length and the ttl's upper bound are left to the library (`try_take`), which runs after
/// the pool is opened and the schema checked. So against a database without tenure's tables
/// a too-long name exits 4 ("run tenure migrate"), against a server that is down 3, and on
/// SQLite the refused command creates the database file (and its WAL) before refusing:
/// "bad input exits 2 and changes nothing" does not hold. Fix: validate name, holder and
/// ttl (`tenure::validate`-equivalent checks, or `LeaseGuard`'s) in `run` before
/// `Pool::open`.
fn lease_run_attack_bad_input_is_refused_before_touching_the_database(backend: Backend) {
    let db = TestDb::empty(backend);
    let dir = tempfile::tempdir().unwrap();
    let url = match backend {
        // A file that does not exist yet: a refused command must not create it.
        Backend::Sqlite => dir.path().join("never.db").display().to_string(),
        _ => db.url().to_string(),
    };
    let too_long = "n".repeat(256);
    let holder = "h".repeat(256);
    let mut wrong = Vec::new();
    for args in [
        &["lease", "run", too_long.as_str(), "--", "true"][..],
        &["lease", "run", "x", "--holder", &holder, "--", "true"],
        &["lease", "run", "x", "--ttl", "400d", "--", "true"],
    ] {
        let out = tenure(&url, args);
        if out.status.code() != Some(2) {
            wrong.push(format!(
                "{:?}: {:?} {}",
                &args[2..],
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    if backend == Backend::Sqlite && Path::new(&url).exists() {
        wrong.push("refused runs created the SQLite database file".into());
    }
    assert!(
        wrong.is_empty(),
        "bad input not refused with 2 up front: {wrong:#?}"
    );
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
    super::ok(url, &["leases", "release", "fr", "--force"]);
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
    super::ok(url, &["leases", "release", "pipe", "--force"]);
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

/// The lease's `expires_at`, as `tenure leases list --json` says.
#[cfg(feature = "postgres")]
fn expires_at(url: &str, name: &str) -> String {
    json(url, &["leases", "list"])
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .map(|l| l["expires_at"].to_string())
        .unwrap_or_default()
}

/// Was a defect, found by this attack and fixed: like the partition above, but the runner's pool holds an idle, healthy connection
/// when the network is cut, which happens after any renewal failed for a transient reason
/// (here a `lock_timeout` while an operator's transaction held the lease's row for 3 s; also
/// a MariaDB lock wait timeout, a failover): the guard renews on a fresh pooled connection
/// and the old one goes back to the pool. Once the network is cut, the local deadline fires
/// and the command is stopped, but `why_lost` checks out that idle connection and r2d2's
/// check-out test (`SELECT 1`) blocks on the dead TCP connection with no timeout: the runner
/// never exits (not 76, no message, hours until TCP keepalive gives up), though its command
/// is gone. Fix: say why without blocking: look the lease up with a bound (a
/// `Pool::options().connection_timeout(..)` of a few seconds does not cover a check-out test
/// stuck reading; set `statement_timeout`/TCP user timeout on the runner's connections, or
/// run `why_lost` on a thread and give up after a few seconds with "the database cannot be
/// reached"), and never let the release on drop delay the exit beyond RELEASE_WAIT.
#[cfg(feature = "postgres")]
#[test]
fn lease_run_attack_partition_after_a_lock_timeout_ends_the_runner() {
    let backend = Backend::Postgres;
    let db = TestDb::migrated(backend);
    let database = url::Url::parse(db.url()).unwrap().path()[1..].to_string();
    let mut admin = db.connect();
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {database} SET lock_timeout = '1s'"
        ))
        .unwrap();
    let proxy = Proxy::start(db.url(), backend);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut a = Runner::start(
        &proxy.url,
        d,
        "a",
        &[
            "cut",
            "--ttl",
            "12s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            &stoppable("a"),
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    // A renewal (every 4 s) meets the row lock, times out after 1 s and is retried on a
    // fresh connection; the old one goes back to the pool, idle and healthy.
    admin
        .batch_execute("BEGIN; SELECT * FROM tenure_leases WHERE name = 'cut' FOR UPDATE")
        .unwrap();
    std::thread::sleep(Duration::from_secs(6));
    let before = expires_at(db.url(), "cut");
    admin.batch_execute("ROLLBACK").unwrap();
    wait_until(LONG, "a renewal succeeds again", || {
        expires_at(db.url(), "cut") != before
    });
    assert!(
        group_alive(pgid),
        "the lease was lost already: {}",
        a.stderr()
    );

    proxy.freeze();
    let cut = Instant::now();
    wait_until(LONG, "the cut-off runner stops its command", || {
        !group_alive(pgid)
    });
    eprintln!("network cut -> command stopped after {:.2?}", cut.elapsed());
    // Far beyond the pool's 30 s connection timeout plus RELEASE_WAIT: not a slow exit, a
    // hang.
    let status = a.exit(Duration::from_secs(120));
    let message = a.stderr();
    eprintln!("network cut -> runner exited after {:.2?}", cut.elapsed());
    assert_eq!(status.code(), Some(76), "{message}");
    assert!(message.contains("lost the lease"), "{message}");
}

/// Was a defect, found by this attack and fixed: the database cannot be reached (a partition: the connection attempt hangs, no
/// refusal) when `tenure lease run` starts, and the operator gives up: SIGTERM (or Ctrl-C)
/// does nothing. `run` installs its handlers before opening the pool, so the signals only
/// set a bit that `take` would look at between attempts, and the connection attempt
/// (libpq without `connect_timeout`, the MariaDB handshake) never returns: the runner stays
/// until SIGKILL. The same holds for any database call that hangs while waiting for the
/// lease. The help promises "128+N: signal N arrived while waiting: not run". Fix: until
/// the command is started, let the handler restore the default action and re-raise the
/// signal (both async-signal-safe) when no command runs yet, or do the database calls of
/// the waiting phase on a thread and wait on signals in the main one; and give the pool a
/// connect timeout.
fn lease_run_attack_partition_sigterm_while_connecting_ends_the_runner(backend: Backend) {
    let db = TestDb::migrated(backend);
    let proxy = Proxy::start(db.url(), backend);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    proxy.freeze();
    let mut a = Runner::start(
        &proxy.url,
        d,
        "a",
        &["cut", "--", "sh", "-c", "touch \"$DIR/ran\""],
    );
    // Connecting (it hangs): give it time to be well inside the connection attempt.
    std::thread::sleep(Duration::from_secs(2));
    assert!(a.child.try_wait().unwrap().is_none(), "{}", a.stderr());
    a.signal("TERM");
    // It should end at once; 20 s is plenty on any machine, and shorter than the servers'
    // own handshake timeouts (PostgreSQL's authentication_timeout is 60 s, after which the
    // runner exits 3, the signal still ignored).
    let status = a.exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(143), "{}", a.stderr());
    assert!(!d.join("ran").exists());
}

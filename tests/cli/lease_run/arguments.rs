//! `tenure lease run`'s arguments: hostile ones, and bad input refused before the database is
//! touched.
//!
//! Timing bounds are wide (a loaded machine): each bounds a latency far above what it should
//! be, never measures it tightly. Tests that found a defect say so in their doc comment.

use std::path::Path;
use std::process::{Command, Stdio};

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::lease_run::{LONG, Runner, group_alive, lease_state, read, read_number};
use crate::{json, tenure};

conformance!(
    lease_run_attack_hostile_arguments,
    lease_run_attack_bad_input_is_refused_before_touching_the_database,
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

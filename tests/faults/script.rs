//! `scripts/test` itself: the whole suite, fault scenarios included, in one nextest run whose
//! failure fails the script (it used to run two stages, and `set -e` once ended it at the
//! first failing one, skipping the fault scenarios).
//!
//! The script runs against a stand-in `cargo` (first on `PATH`) that records its arguments and
//! exits as told; the servers' URLs and restart commands are given, so it starts no server.

use std::path::Path;
use std::process::Command;

const FAKE_CARGO: &str = r#"#!/bin/sh
echo "$*" >> "$FAKE_CARGO_LOG"
case "$*" in
    "nextest run"*) exit "$FAKE_NEXTEST_EXIT" ;;
esac
exit 0
"#;

struct Run {
    success: bool,
    stdout: String,
    /// The filter of each `cargo nextest run` the script started (empty: none).
    runs: Vec<String>,
}

fn run_script(nextest_exit: i32) -> Run {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cargo = dir.path().join("cargo");
    std::fs::write(&cargo, FAKE_CARGO).expect("write the stand-in cargo");
    let chmod = Command::new("chmod").arg("+x").arg(&cargo).status();
    assert!(chmod.is_ok_and(|s| s.success()), "chmod the stand-in cargo");
    let log = dir.path().join("cargo.log");
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/test");
    let output = Command::new("bash")
        .arg(&script)
        .env("PATH", path)
        .env("FAKE_CARGO_LOG", &log)
        .env("FAKE_NEXTEST_EXIT", nextest_exit.to_string())
        .env(
            "TENURE_TEST_POSTGRES_URL",
            "postgres://unused@127.0.0.1:1/unused",
        )
        .env("TENURE_TEST_MYSQL_URL", "mysql://unused@127.0.0.1:1/unused")
        // Servers to restart are given: the script starts no private ones.
        .env("TENURE_TEST_RESTART_POSTGRES", "true")
        .env("TENURE_TEST_RESTART_MYSQL", "true")
        .env(
            "TENURE_TEST_RESTARTABLE_POSTGRES_URL",
            "postgres://unused@127.0.0.1:1/unused",
        )
        .env(
            "TENURE_TEST_RESTARTABLE_MYSQL_URL",
            "mysql://unused@127.0.0.1:1/unused",
        )
        .output()
        .expect("run scripts/test");
    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    let runs = calls
        .lines()
        .filter(|line| line.starts_with("nextest run"))
        .map(|line| {
            line.split_once(" -E ")
                .map_or(String::new(), |(_, f)| f.to_string())
        })
        .collect();
    Run {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        runs,
    }
}

#[test]
fn scripts_test_runs_everything_once_and_fails_when_it_fails() {
    let failed = run_script(100);
    assert_eq!(failed.runs, [""], "one run, no filter: {}", failed.stdout);
    assert!(!failed.success, "a failed run fails the script");
    assert!(
        failed.stdout.contains("== the suite: FAILED (exit 100)"),
        "{}",
        failed.stdout
    );

    let passed = run_script(0);
    assert_eq!(passed.runs, [""]);
    assert!(passed.success, "{}", passed.stdout);
    assert!(
        passed.stdout.contains("== the suite: passed"),
        "{}",
        passed.stdout
    );
}

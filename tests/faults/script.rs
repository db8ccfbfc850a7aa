//! `scripts/test` itself: a failure of the parallel suite does not skip the serial fault
//! scenarios; both stages are reported and the script fails if either failed (item 13:
//! `set -e` used to end the script at the first failing stage).
//!
//! The script runs against a stand-in `cargo` (first on `PATH`) that records its arguments
//! and fails the stage it is told to; the servers' URLs are set, so the script starts none.

use std::path::Path;
use std::process::Command;

const FAKE_CARGO: &str = r#"#!/bin/sh
echo "$*" >> "$FAKE_CARGO_LOG"
case "$*" in
    *"not test(/^serial::/)"*) exit "$FAKE_PARALLEL_EXIT" ;;
    *"test(/^serial::/)"*) exit "$FAKE_SERIAL_EXIT" ;;
esac
exit 0
"#;

struct Run {
    success: bool,
    stdout: String,
    /// The `cargo nextest run` stages the script started, in order.
    stages: Vec<&'static str>,
}

fn run_script(parallel_exit: i32, serial_exit: i32) -> Run {
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
        .env("FAKE_PARALLEL_EXIT", parallel_exit.to_string())
        .env("FAKE_SERIAL_EXIT", serial_exit.to_string())
        .env(
            "TENURE_TEST_POSTGRES_URL",
            "postgres://unused@127.0.0.1:1/unused",
        )
        .env("TENURE_TEST_MYSQL_URL", "mysql://unused@127.0.0.1:1/unused")
        // The stand-in cargo needs no servers: none are started for it.
        .env("TENURE_TEST_SERIAL_SERVERS", "given")
        .output()
        .expect("run scripts/test");
    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    let stages = calls
        .lines()
        .filter(|line| line.starts_with("nextest run"))
        .map(|line| {
            if line.contains("not test(/^serial::/)") {
                "parallel"
            } else {
                "serial"
            }
        })
        .collect();
    Run {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stages,
    }
}

#[test]
fn scripts_test_runs_the_serial_stage_after_a_failure_and_reports_both() {
    let failed_first = run_script(100, 0);
    assert_eq!(
        failed_first.stages,
        ["parallel", "serial"],
        "{}",
        failed_first.stdout
    );
    assert!(
        !failed_first.success,
        "a failed parallel stage fails the script"
    );
    assert!(
        failed_first
            .stdout
            .contains("== parallel suite: FAILED (exit 100)")
    );
    assert!(
        failed_first
            .stdout
            .contains("== serial fault scenarios: passed")
    );

    let failed_second = run_script(0, 100);
    assert_eq!(failed_second.stages, ["parallel", "serial"]);
    assert!(
        !failed_second.success,
        "a failed serial stage fails the script"
    );
    assert!(failed_second.stdout.contains("== parallel suite: passed"));
    assert!(
        failed_second
            .stdout
            .contains("== serial fault scenarios: FAILED (exit 100)")
    );

    let passed = run_script(0, 0);
    assert_eq!(passed.stages, ["parallel", "serial"]);
    assert!(passed.success, "{}", passed.stdout);
}

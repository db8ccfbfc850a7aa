//! `tenure enqueue --wait`: it waits for the job's end (run by a `tenure work` process, so
//! the end is seen across processes), prints how it ended, and exits with a code that says
//! it: 0 completed, 5 dead, 6 cancelled, 7 not ended within --timeout. A worker killed
//! mid-run is not an end: the wait goes on to the rescued run's.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use tenure::Backend;
use tenure::jobs::{self, JobFilter, JobState};

use super::common::{TestDb, conformance, wait_until};
use super::{Worker, tenure};

conformance!(
    enqueue_wait_exits_with_how_the_job_ended,
    enqueue_wait_outlasts_a_killed_worker_and_reports_the_rescued_runs_end,
);

fn start_worker(url: &str, queue: &str) -> Worker {
    Worker(
        Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args(["--database-url", url, "work", "--queue", queue])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tenure work"),
    )
}

/// `tenure --json enqueue --queue Q --command C --wait ...extra`, in the background.
fn spawn_wait(url: &str, queue: &str, command: &str, extra: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["--database-url", url, "--json", "enqueue", "--queue", queue])
        .args(["--command", command, "--wait"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tenure enqueue --wait")
}

/// The exit code and the JSON printed.
fn ended(out: Output) -> (Option<i32>, Value) {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {text:?}; stderr {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), value)
}

fn enqueue_wait(url: &str, queue: &str, command: &str, extra: &[&str]) -> (Option<i32>, Value) {
    let mut args = vec!["--json", "enqueue", "--queue", queue, "--command", command];
    args.push("--wait");
    args.extend_from_slice(extra);
    ended(tenure(url, &args))
}

fn enqueue_wait_exits_with_how_the_job_ended(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let _worker = start_worker(url, "w");
    let (code, value) = enqueue_wait(url, "w", "echo done", &["--timeout", "2m"]);
    assert_eq!(
        (code, value["state"].as_str()),
        (Some(0), Some("completed")),
        "{value}"
    );
    let (code, value) = enqueue_wait(url, "w", "exit 3", &["--max-attempts", "1"]);
    assert_eq!(
        (code, value["state"].as_str()),
        (Some(5), Some("dead")),
        "{value}"
    );
    assert!(
        value["error"].as_str().is_some_and(|e| e.contains('3')),
        "{value}"
    );
    // Cancelled while it runs.
    let waiter = spawn_wait(url, "w", "sleep 300", &[]);
    let mut conn = db.connect();
    let running = JobFilter {
        state: Some(JobState::Running),
        ..Default::default()
    };
    let id = wait_until("the job to run", Duration::from_secs(60), || {
        jobs::list(&mut conn, &running)
            .unwrap()
            .first()
            .map(|job| job.id)
    });
    assert!(jobs::cancel(&mut conn, id).unwrap());
    let (code, value) = ended(waiter.wait_with_output().unwrap());
    assert_eq!(
        (code, value["state"].as_str()),
        (Some(6), Some("cancelled")),
        "{value}"
    );
    assert_eq!(value["id"].as_i64(), Some(id));
    // Nobody serves this queue: the wait ends at its timeout, the job still waiting.
    let (code, value) = enqueue_wait(url, "nobody", "true", &["--timeout", "300ms"]);
    assert_eq!(
        (code, value["state"].as_str()),
        (Some(7), Some("waiting")),
        "{value}"
    );
    assert_eq!(value["ended"], Value::Bool(false));
    // --timeout without --wait, and a bad timeout, are bad arguments (exit 2).
    let out = tenure(
        url,
        &[
            "enqueue",
            "--queue",
            "w",
            "--command",
            "true",
            "--timeout",
            "1s",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let out = tenure(
        url,
        &[
            "enqueue",
            "--queue",
            "w",
            "--command",
            "true",
            "--wait",
            "--timeout",
            "soon",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
}

fn enqueue_wait_outlasts_a_killed_worker_and_reports_the_rescued_runs_end(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("first-run");
    // The first run marks and hangs; the rescued one sees the mark and completes.
    let command = format!(
        "if [ -f '{m}' ]; then echo second; else touch '{m}'; sleep 300; fi",
        m = mark.display()
    );
    let mut first = start_worker(url, "k");
    let waiter = spawn_wait(url, "k", &command, &["--timeout", "5m"]);
    wait_until("the first run", Duration::from_secs(60), || {
        mark.exists().then_some(())
    });
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let _second = start_worker(url, "k");
    let (code, value) = ended(waiter.wait_with_output().unwrap());
    assert_eq!(
        (code, value["state"].as_str()),
        (Some(0), Some("completed")),
        "{value}"
    );
    let id = value["id"].as_i64().unwrap();
    let job = jobs::get(&mut db.connect(), id).unwrap().unwrap();
    assert_eq!((job.lapses, job.attempt), (1, 1), "{job:?}");
}

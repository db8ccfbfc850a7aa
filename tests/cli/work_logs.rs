//! `tenure work` logs a line per job (human or JSON) and never claims kinds it cannot run.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob};

use crate::common::{TestDb, conformance, poll_until};
use crate::{ok, queue_figure};

conformance!(work_logs_each_job_and_leaves_other_kinds_alone,);

fn work_logs_each_job_and_leaves_other_kinds_alone(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    // Another program's kind on the same queue, due first.
    let other = jobs::enqueue(
        &mut conn,
        &NewJob::json("w", "resize", &json!({"image": 1}))
            .unwrap()
            .priority(-1),
    )
    .unwrap()
    .id;
    let shell = |command: &str| NewJob::json("w", "shell", &json!({ "command": command })).unwrap();
    for (round, format) in [(1, "json"), (2, "human")] {
        let ok = jobs::enqueue(&mut conn, &shell("true")).unwrap().id;
        let failing = jobs::enqueue(&mut conn, &shell("exit 4").max_attempts(1))
            .unwrap()
            .id;
        let mut worker = Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args([
                "--database-url",
                url,
                "work",
                "--queue",
                "w",
                "--log-format",
                format,
            ])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        poll_until(Duration::from_secs(60), Duration::from_millis(100), || {
            (queue_figure(url, "w", "completed") >= round
                && queue_figure(url, "w", "dead") >= round)
                .then_some(())
        })
        .expect("the worker did not run both jobs");
        Command::new("kill")
            .args(["-TERM", &worker.id().to_string()])
            .status()
            .unwrap();
        let status = worker.wait().unwrap();
        assert!(status.success(), "{status:?}");
        let mut log = String::new();
        worker
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        if format == "json" {
            let lines: Vec<Value> = log
                .lines()
                .filter_map(|line| serde_json::from_str(line).ok())
                .filter(|line: &Value| line["target"] == "tenure::job")
                .collect();
            let outcome = |id: i64| {
                lines
                    .iter()
                    .find(|l| l["job.id"] == id)
                    .map(|l| l["outcome"].as_str().unwrap_or_default().to_string())
            };
            assert_eq!(outcome(ok).as_deref(), Some("completed"), "{log}");
            assert_eq!(outcome(failing).as_deref(), Some("dead"), "{log}");
            let dead = lines.iter().find(|l| l["job.id"] == failing).unwrap();
            assert!(
                dead["error"].as_str().unwrap().contains("exit code 4"),
                "{log}"
            );
            assert_eq!(dead["kind"], "shell");
            assert!(outcome(other).is_none(), "{log}");
        } else {
            let line = |id: i64| {
                log.lines()
                    .find(|l| l.contains("tenure::job") && l.contains(&format!("job.id={id} ")))
                    .unwrap_or_default()
            };
            assert!(line(ok).contains("job completed"), "{log}");
            assert!(
                line(failing).contains("job dead") && line(failing).contains("exit code 4"),
                "{log}"
            );
            assert!(!log.lines().any(|l| l.starts_with('{')), "{log}");
        }
        let job = jobs::get(&mut conn, other).unwrap().unwrap();
        assert_eq!((job.state, job.attempt), (JobState::Waiting, 0), "{job:?}");
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A migrated SQLite file in `dir`, and its path as a URL.
fn migrated(dir: &Path) -> String {
    let url = dir.join("jobs.db").display().to_string();
    ok(&url, &["migrate"]);
    url
}

/// `tenure work` said its grace period in Debug form ("grace 0ns", "grace 8639999999913600s").
#[test]
fn work_says_its_grace_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let url = migrated(dir.path());
    let child = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args([
            "--database-url",
            &url,
            "work",
            "--queue",
            "q",
            "--grace",
            "90s",
        ])
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("stopping (grace 90s)"),
        "{}",
        stderr(&out)
    );
}

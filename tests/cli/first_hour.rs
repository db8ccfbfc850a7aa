//! What a new user meets in the first hour with the command: queues paused and resumed from
//! the command line, a secret given to a shell job by name only (`--env-from`), the default
//! number of attempts a task-spooler user expects, a failed command's error that says it
//! printed nothing, and `:memory:` refused with what to do instead.
//!
//! Found by the first-hour review (issue 31, item 8 and 9).

use std::process::{Command, Stdio};
use std::time::Duration;

use tenure::Backend;
use tenure::jobs;

use super::common::{TestDb, conformance, poll_until};
use super::{Worker, json, ok, queue_figure, tenure};

conformance!(
    queues_pause_and_resume_from_the_command,
    env_from_passes_the_workers_variable_and_stores_only_its_name,
);

fn queues_pause_and_resume_from_the_command(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    ok(url, &["enqueue", "--queue", "q", "--command", "true"]);
    let said = ok(url, &["queues", "pause", "q"]);
    assert!(said.contains("paused"), "{said}");
    let stats = json(url, &["stats"]);
    let queue = |stats: &serde_json::Value| {
        stats["queues"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["queue"] == "q")
            .cloned()
            .unwrap()
    };
    assert_eq!(queue(&stats)["paused"], true, "{stats}");
    // Paused: no claim takes its job.
    let mut conn = db.connect();
    let claimed = jobs::claim(&mut conn, "q", 10, Duration::from_secs(30)).unwrap();
    assert!(claimed.is_empty(), "a paused queue's job was claimed");
    assert_eq!(json(url, &["queues", "resume", "q"])["paused"], false);
    assert_eq!(queue(&json(url, &["stats"]))["paused"], false);
    let claimed = jobs::claim(&mut conn, "q", 10, Duration::from_secs(30)).unwrap();
    assert_eq!(claimed.len(), 1, "the resumed queue's job is claimed");
    // Bad input changes nothing.
    let out = tenure(url, &["queues", "pause", ""]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

fn env_from_passes_the_workers_variable_and_stores_only_its_name(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let written = dir.path().join("token");
    let secret = "from-the-workers-environment-7f3a";
    let command = format!("printf %s \"$API_TOKEN\" > '{}'", written.display());
    let id = json(
        url,
        &[
            "enqueue",
            "--queue",
            "env",
            "--command",
            &command,
            "--env-from",
            "API_TOKEN",
        ],
    )["id"]
        .as_i64()
        .unwrap();
    // A shell job's default: 3 attempts, not 25.
    let shown = json(url, &["jobs", "show", &id.to_string()]);
    assert_eq!(shown["max_attempts"], 3, "{shown}");
    let text = ok(url, &["jobs", "show", &id.to_string()]);
    assert!(
        text.contains("API_TOKEN from the worker's environment"),
        "{text}"
    );
    let missing = json(
        url,
        &[
            "enqueue",
            "--queue",
            "env",
            "--command",
            "true",
            "--env-from",
            "NOT_SET_ANYWHERE_9c1",
            "--max-attempts",
            "1",
        ],
    )["id"]
        .as_i64()
        .unwrap();
    let silent = json(
        url,
        &[
            "enqueue",
            "--queue",
            "env",
            "--command",
            "exit 2",
            "--max-attempts",
            "1",
        ],
    )["id"]
        .as_i64()
        .unwrap();
    let _worker = Worker(
        Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args(["--database-url", url, "work", "--queue", "env"])
            .env("API_TOKEN", secret)
            .env_remove("NOT_SET_ANYWHERE_9c1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    poll_until(Duration::from_secs(60), Duration::from_millis(100), || {
        (queue_figure(url, "env", "completed") >= 1 && queue_figure(url, "env", "dead") >= 2)
            .then_some(())
    })
    .expect("the worker did not finish the three jobs");
    assert_eq!(std::fs::read_to_string(&written).unwrap(), secret);
    // Only the name is stored.
    let mut conn = db.connect();
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert!(!String::from_utf8_lossy(&job.payload).contains(secret));
    let missing = jobs::get(&mut conn, missing).unwrap().unwrap();
    let error = missing.last_error.unwrap_or_default();
    assert!(error.contains("NOT_SET_ANYWHERE_9c1"), "{error}");
    let silent = jobs::get(&mut conn, silent).unwrap().unwrap();
    assert_eq!(
        silent.last_error.as_deref(),
        Some("exit code 2 (the command printed nothing)")
    );
}

#[test]
fn an_in_memory_database_is_refused_with_what_to_do() {
    for url in [":memory:", "sqlite://:memory:", "file:x?mode=memory"] {
        let out = tenure(url, &["stats"]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {said}");
        assert!(said.contains("SQLite file's path"), "{url}: {said}");
        assert!(!said.contains("max_size"), "{url}: {said}");
    }
}

#[test]
fn enqueue_help_explains_every_option() {
    let out = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["enqueue", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for line in help.lines().filter(|l| l.trim_start().starts_with("--")) {
        let described = line
            .split_once("  ")
            .is_some_and(|(_, text)| !text.trim().is_empty());
        let next_described = help
            .lines()
            .skip_while(|l| *l != line)
            .nth(1)
            .is_some_and(|next| next.starts_with("          ") && !next.trim().is_empty());
        assert!(
            described || next_described,
            "no text for {line:?} in:\n{help}"
        );
    }
    assert!(
        help.contains("default: 3") || help.contains("[default: 3]"),
        "{help}"
    );
}

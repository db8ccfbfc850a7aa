//! End-to-end tests of the `tenure` command on every backend.

// The harness shared by the three test binaries (see tests/common/mod.rs).
#[path = "../common/mod.rs"]
#[allow(dead_code, unused_macros, unused_imports)]
mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{TestDb, conformance};
use serde_json::Value;
use tenure::Backend;

mod browser;
mod dashboard;
mod database;
mod enqueue;
mod enqueue_wait;
mod first_hour;
mod flow_control;
mod jobs_show;
mod lease_run;
mod output;
mod parked;
mod schedules;
mod secrets;
mod secrets_masking;
mod sequences;
mod serve;
mod steps_shown;
mod webdriver;
mod work_children;
mod work_logs;
mod workflows;

conformance!(
    the_command_runs_and_steers_the_queue,
    leases_and_schedules_from_the_command
);

fn tenure(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tenure"))
        .arg("--database-url")
        .arg(url)
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run tenure")
}

/// Runs `tenure` and returns its stdout, asserting exit code 0.
fn ok(url: &str, args: &[&str]) -> String {
    let out = tenure(url, args);
    assert!(
        out.status.success(),
        "tenure {args:?}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn json(url: &str, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(url, &all)).expect("JSON output")
}

fn queue_figure(url: &str, queue: &str, state: &str) -> i64 {
    json(url, &["stats"])["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == queue)
        .map_or(0, |q| q[state].as_i64().unwrap())
}

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn the_command_runs_and_steers_the_queue(backend: Backend) {
    let db = TestDb::empty(backend);
    let url = db.url();
    // Before migrations: a clear error and exit code 4.
    let out = tenure(url, &["stats"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tenure migrate"));
    assert!(ok(url, &["migrate"]).contains("applied"));

    let hello = json(
        url,
        &[
            "enqueue",
            "--queue",
            "ops",
            "--command",
            "echo hello-$WHO; echo to-stderr >&2",
            "--env",
            "WHO=tenure",
        ],
    );
    let hello = hello["id"].as_i64().unwrap();
    let failing = json(
        url,
        &[
            "enqueue",
            "--queue",
            "ops",
            "--command",
            "echo failing; exit 3",
            "--max-attempts",
            "1",
        ],
    );
    let failing = failing["id"].as_i64().unwrap();

    let worker = Worker(
        Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args([
                "--database-url",
                url,
                "work",
                "--queue",
                "ops",
                "--threads",
                "2",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::poll_until(Duration::from_secs(30), Duration::from_millis(100), || {
        (queue_figure(url, "ops", "completed") >= 1 && queue_figure(url, "ops", "dead") >= 1)
            .then_some(())
    })
    .expect("the worker did not run both jobs");
    // SIGTERM: a graceful stop, exit code 0.
    let mut worker = worker;
    Command::new("kill")
        .args(["-TERM", &worker.0.id().to_string()])
        .status()
        .unwrap();
    let status = worker.0.wait().unwrap();
    assert!(status.success(), "{status:?}");

    let shown = json(url, &["jobs", "show", &hello.to_string()]);
    assert_eq!(shown["state"], "completed");
    let output = shown["outputs"][0]["output"].as_str().unwrap();
    assert!(
        output.contains("hello-tenure") && output.contains("to-stderr"),
        "{shown}"
    );
    assert_eq!(shown["outputs"][0]["exit_code"], 0);
    let dead = json(url, &["jobs", "list", "--state", "dead"]);
    assert_eq!(dead.as_array().unwrap().len(), 1);
    assert_eq!(dead[0]["id"], failing);
    assert!(
        dead[0]["last_error"]
            .as_str()
            .unwrap()
            .contains("exit code 3")
    );
    let shown = json(url, &["jobs", "show", &failing.to_string()]);
    assert_eq!(shown["outputs"][0]["exit_code"], 3);

    // Human output: a table naming the queue.
    let table = ok(url, &["stats"]);
    assert!(table.contains("queue") && table.contains("ops"), "{table}");
    assert!(ok(url, &["jobs", "list"]).contains("completed"));

    // Retry the dead job, then cancel it; a second cancel has nothing to act on.
    ok(url, &["jobs", "retry", &failing.to_string()]);
    assert_eq!(
        json(url, &["jobs", "show", &failing.to_string()])["state"],
        "waiting"
    );
    ok(url, &["jobs", "cancel", &failing.to_string()]);
    assert_eq!(
        tenure(url, &["jobs", "cancel", &failing.to_string()])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        tenure(url, &["jobs", "show", "999999"]).status.code(),
        Some(1)
    );
    // Prune the finished jobs.
    assert_eq!(
        json(url, &["jobs", "prune", "--queue", "ops"])["deleted"],
        1
    );
    // Bad input: exit code 2, nothing written.
    assert_eq!(
        tenure(url, &["enqueue", "--queue", "", "--command", "true"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        tenure(url, &["enqueue", "--queue", "q", "--delay", "soon"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        tenure(url, &["jobs", "list", "--state", "sleeping"])
            .status
            .code(),
        Some(2)
    );
}

fn leases_and_schedules_from_the_command(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    tenure::lease::try_take(&mut conn, "backup", Duration::from_secs(60), "host-a")
        .unwrap()
        .unwrap();
    let leases = json(url, &["leases", "list"]);
    assert_eq!(leases[0]["name"], "backup");
    assert_eq!(leases[0]["held"], true);
    // Releasing someone's lease needs --force.
    assert_eq!(
        tenure(url, &["leases", "release", "backup"]).status.code(),
        Some(2)
    );
    ok(url, &["leases", "release", "backup", "--force"]);
    assert_eq!(json(url, &["leases", "list"])[0]["held"], false);

    ok(
        url,
        &[
            "schedules",
            "add",
            "nightly",
            "--cron",
            "0 3 * * *",
            "--time-zone",
            "Europe/Lisbon",
            "--queue",
            "ops",
            "--command",
            "echo backup",
        ],
    );
    ok(
        url,
        &[
            "schedules",
            "add",
            "often",
            "--every",
            "30s",
            "--queue",
            "ops",
            "--command",
            "true",
        ],
    );
    let list = json(url, &["schedules", "list"]);
    assert_eq!(list.as_array().unwrap().len(), 2);
    ok(url, &["schedules", "pause", "nightly"]);
    assert_eq!(json(url, &["schedules", "list"])[0]["paused"], true);
    ok(url, &["schedules", "remove", "often"]);
    assert_eq!(
        tenure(url, &["schedules", "remove", "often"]).status.code(),
        Some(1)
    );
    assert_eq!(
        tenure(
            url,
            &[
                "schedules",
                "add",
                "bad",
                "--cron",
                "61 * * * *",
                "--queue",
                "ops"
            ]
        )
        .status
        .code(),
        Some(2)
    );
    assert!(ok(url, &["schedules", "list"]).contains("Europe/Lisbon"));
}

/// A URL tenure cannot use, and servers that cannot be reached: clear messages, distinct exit
/// codes, and the password never printed.
#[test]
fn bad_urls_and_unreachable_servers() {
    let out = tenure("ftp://example.com/db", &["stats"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!String::from_utf8_lossy(&out.stderr).is_empty());
    for url in [
        "postgres://root:s3cret-pw@127.0.0.1:1/nowhere",
        "mysql://root:s3cret-pw@127.0.0.1:1/nowhere",
    ] {
        let out = tenure(url, &["stats"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{url}: {stderr}");
        assert!(stderr.contains("connect"), "{stderr}");
        for text in [&stderr, &String::from_utf8_lossy(&out.stdout)] {
            assert!(!text.contains("s3cret-pw"), "the password leaked: {text}");
        }
    }
}

/// Hostile command lines: any mix of subcommands, flags and junk ends with a documented exit
/// code (0-4) and a message, never a panic (101) or a signal.
#[test]
fn random_arguments_end_with_a_documented_exit_code() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let db = TestDb::migrated(Backend::Sqlite);
    let url = db.url().to_string();
    // `work` and `demo` run until stopped; everything else is fair game.
    let command = prop::sample::select(vec![
        vec!["stats"],
        vec!["migrate"],
        vec!["jobs", "list"],
        vec!["jobs", "show"],
        vec!["jobs", "retry"],
        vec!["jobs", "cancel"],
        vec!["jobs", "prune"],
        vec!["leases", "list"],
        vec!["leases", "release"],
        vec!["schedules", "list"],
        vec!["schedules", "add"],
        vec!["schedules", "pause"],
        vec!["schedules", "remove"],
        vec!["enqueue"],
        vec!["workflows", "list"],
        vec!["workflows", "show"],
        vec!["workflows", "cancel"],
        vec!["jobs"],
        vec![],
    ]);
    let token = prop_oneof![
        prop::sample::select(vec![
            "--queue",
            "--state",
            "--kind",
            "--limit",
            "--json",
            "--keep",
            "--older-than",
            "--cron",
            "--every",
            "--time-zone",
            "--command",
            "--env",
            "--payload",
            "--delay",
            "--dedup-key",
            "--force",
            "--priority",
            "--max-attempts",
            "1",
            "0",
            "-1",
            "99999999999999999999",
            "q",
            "",
            "=",
            "A=b",
            "\u{0}",
            "'; DROP TABLE tenure_jobs; --",
            "*/0 * * * *",
            "61 * * * *",
            "1h",
            "10x",
            "waiting",
            "dead",
            "😀",
        ])
        .prop_map(str::to_string),
        prop::collection::vec(any::<char>(), 0..12)
            .prop_map(|c| c.into_iter().filter(|c| *c != '\0').collect::<String>()),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(
            &(command, prop::collection::vec(token, 0..6)),
            |(command, tokens)| {
                let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
                args.extend(tokens.into_iter().filter(|t| !t.contains('\0')));
                let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let out = tenure(&url, &refs);
                let code = out.status.code();
                prop_assert!(
                    matches!(code, Some(0..=4)),
                    "tenure {args:?} ended {:?}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok(())
            },
        )
        .unwrap();
}

//! `tenure enqueue` and other commands refusing what cannot run: shell jobs that cannot start,
//! bad arguments refused before the database is opened, and nothing enqueued by a refusal.

use std::path::Path;
use std::process::Output;

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::{json, ok, tenure};

conformance!(
    jobs_that_cannot_run_are_refused_and_nothing_is_enqueued,
    a_lower_priority_number_is_claimed_first_as_the_help_says,
    a_fair_key_takes_its_tenant_s_turn_behind_another_s_backlog,
);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts exit code `code` and a message holding every one of `words`.
fn fails(out: &Output, code: i32, words: &[&str]) {
    let text = stderr(out);
    assert_eq!(out.status.code(), Some(code), "{text}");
    for word in words {
        assert!(text.contains(word), "{word:?} missing from: {text}");
    }
}

/// A migrated SQLite file in `dir`, and its path as a URL.
fn migrated(dir: &Path) -> String {
    let url = dir.join("jobs.db").display().to_string();
    ok(&url, &["migrate"]);
    url
}

fn job_count(url: &str) -> usize {
    let out = ok(url, &["--json", "jobs", "list", "--limit", "1000"]);
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    list.as_array().unwrap().len()
}

/// A shell job /bin/sh can never be started with (a NUL byte in the command or an
/// environment value, an environment name empty or holding `=`) was enqueued, and retried
/// 25 times with "nul byte found in provided data".
#[test]
fn shell_jobs_that_cannot_start_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let url = migrated(dir.path());
    for payload in [
        r#"{"command": "a\u0000b"}"#,
        r#"{"command": "true", "env": {"A": "x\u0000y"}}"#,
        r#"{"command": "true", "env": {"": "x"}}"#,
        r#"{"command": "true", "env": {"A=B": "x"}}"#,
    ] {
        let out = tenure(&url, &["enqueue", "--queue", "q", "--payload", payload]);
        fails(&out, 2, &["--payload of a `shell` job"]);
        let out = tenure(
            &url,
            &[
                "schedules",
                "add",
                "s",
                "--every",
                "1m",
                "--queue",
                "q",
                "--payload",
                payload,
            ],
        );
        fails(&out, 2, &["--payload of a `shell` job"]);
    }
    assert_eq!(job_count(&url), 0);
    assert!(ok(&url, &["schedules", "list"]).contains("(none)"));
}

/// Durations out of the library's range (`--every 0s`, `--delay 367d`, `--older-than
/// 400d`), `--older-than` without a unit and an unknown `--time-zone` were checked only
/// after the database was opened: exit 4 on a missing file instead of 2, and messages
/// that named neither the flag nor the value as given ("invalid interval: 0ns", "invalid
/// delay" for --older-than).
#[test]
fn bad_arguments_are_refused_before_the_database_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.db").display().to_string();
    let cases: [(&[&str], &[&str]); 6] = [
        (
            &["schedules", "add", "s", "--every", "0s"],
            &["--every", "\"0s\"", "1ms"],
        ),
        (
            &["schedules", "add", "s", "--every", "400d"],
            &["--every", "\"400d\"", "366d"],
        ),
        (
            &[
                "schedules",
                "add",
                "s",
                "--cron",
                "* * * * *",
                "--time-zone",
                "Mars/Base",
            ],
            &["--time-zone", "Mars/Base"],
        ),
        (
            &["enqueue", "--delay", "367d"],
            &["--delay", "\"367d\"", "366d"],
        ),
        (
            &["jobs", "prune", "--queue", "q", "--older-than", "5"],
            &["--older-than", "no unit"],
        ),
        (
            &["jobs", "prune", "--queue", "q", "--older-than", "400d"],
            &["--older-than", "\"400d\"", "366d"],
        ),
    ];
    for (args, words) in cases {
        let mut all = args.to_vec();
        if args[0] != "jobs" {
            all.extend(["--queue", "q", "--command", "true"]);
        }
        fails(&tenure(&missing, &all), 2, words);
    }
    assert!(!Path::new(&missing).exists());
    // The bounds themselves are taken.
    let url = migrated(dir.path());
    ok(
        &url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--command",
            "true",
            "--delay",
            "366d",
        ],
    );
    ok(
        &url,
        &[
            "schedules",
            "add",
            "s",
            "--every",
            "1ms",
            "--queue",
            "q",
            "--command",
            "true",
        ],
    );
    ok(
        &url,
        &["jobs", "prune", "--queue", "q", "--older-than", "366d"],
    );
}

/// Asserts exit code 2 and a message holding every one of `words`.
fn refused(out: &Output, words: &[&str]) {
    let text = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    for word in words {
        assert!(text.contains(word), "{word:?} missing from: {text}");
    }
}

// From issue 17's command items, end to end (cli/issue17.rs).
fn jobs_that_cannot_run_are_refused_and_nothing_is_enqueued(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let base = ["enqueue", "--queue", "q"];
    let with = |extra: &[&str]| tenure(url, &[&base[..], extra].concat());
    refused(&with(&[]), &["needs --command"]);
    refused(&with(&["--kind", "shell"]), &["needs --command"]);
    refused(
        &with(&["--kind", "resize", "--payload", "not json"]),
        &["--payload is not JSON", "--payload '\"hello\"'"],
    );
    refused(
        &with(&["--kind", "resize", "--command", "true"]),
        &["--command is for `shell` jobs"],
    );
    refused(
        &with(&["--payload", "{\"cmd\": 1}"]),
        &["--payload of a `shell` job"],
    );
    refused(
        &with(&["--command", "true", "--delay", "10"]),
        &["--delay", "no unit", "10s"],
    );
    assert_eq!(json(url, &["jobs", "list"]), serde_json::json!([]));
    // What can run is accepted.
    json(
        url,
        &[&base[..], &["--kind", "resize", "--payload", "{\"id\": 4}"]].concat(),
    );
    json(url, &[&base[..], &["--kind", "tick"]].concat());
    json(
        url,
        &[&base[..], &["--command", "true", "--delay", "10s"]].concat(),
    );
    let listed = json(url, &["jobs", "list"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(3), "{listed}");
    assert_eq!(listed[1]["payload"], "null");
}

/// `--priority`'s help says lower numbers are claimed first (it said "higher" while the
/// claim took lower ones first): two jobs enqueued by the command, the lower number claimed
/// first though enqueued last.
fn a_lower_priority_number_is_claimed_first_as_the_help_says(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let enqueue = |priority: &str| {
        json(
            url,
            &[
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--priority",
                priority,
            ],
        )["id"]
            .as_i64()
            .unwrap()
    };
    let _later = enqueue("5");
    let first = enqueue("-5");
    let help = String::from_utf8_lossy(&tenure(url, &["enqueue", "--help"]).stdout).into_owned();
    assert!(help.contains("lower numbers are claimed first"), "{help}");
    let mut conn = db.connect();
    let claimed =
        tenure::jobs::claim(&mut conn, "q", 1, std::time::Duration::from_secs(60)).unwrap();
    assert_eq!(claimed[0].id, first);
}

fn a_fair_key_takes_its_tenant_s_turn_behind_another_s_backlog(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let enqueue = |tenant: &str| {
        json(
            url,
            &[
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--fair-key",
                tenant,
            ],
        )["id"]
            .as_i64()
            .unwrap()
    };
    for _ in 0..4 {
        enqueue("big");
    }
    let small = enqueue("small");
    let mut conn = db.connect();
    let claimed =
        tenure::jobs::claim(&mut conn, "q", 3, std::time::Duration::from_secs(60)).unwrap();
    assert!(claimed.iter().any(|job| job.id == small), "{claimed:?}");
    let refused = tenure(
        url,
        &["enqueue", "--queue", "q", "--kind", "k", "--fair-key", ""],
    );
    assert!(!refused.status.success());
}

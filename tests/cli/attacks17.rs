//! Attacks on issue 17's promises after the polish pass (SQLite files only: no server is
//! involved). Each test is one break found by hand, fixed in src/bin/tenure/ unless ignored.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use super::{ok, tenure};

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

/// `--env =VALUE` repeated the value (often a secret) in its error, and so did a shell
/// payload whose `env` was a string (serde's "invalid type: string \"TOKEN=...\"").
#[test]
fn env_values_are_not_repeated_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let url = migrated(dir.path());
    let out = tenure(
        &url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--command",
            "true",
            "--env",
            "=hunter2",
        ],
    );
    fails(&out, 2, &["--env", "NAME=VALUE"]);
    assert!(!stderr(&out).contains("hunter2"), "{}", stderr(&out));
    let out = tenure(
        &url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--payload",
            r#"{"command": "true", "env": "TOKEN=hunter2"}"#,
        ],
    );
    fails(&out, 2, &["--payload of a `shell` job", "line 1 column"]);
    assert!(!stderr(&out).contains("hunter2"), "{}", stderr(&out));
    assert_eq!(job_count(&url), 0);
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

/// A cron expression whose date never comes ("0 0 31 2 *") passed the field check and
/// failed after the database was opened with "no next tick: CronScheduler time search
/// limit exceeded".
#[test]
fn a_cron_expression_that_never_fires_is_refused_first() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.db").display().to_string();
    let out = tenure(
        &missing,
        &[
            "schedules",
            "add",
            "s",
            "--cron",
            "0 0 31 2 *",
            "--queue",
            "q",
            "--command",
            "true",
        ],
    );
    fails(&out, 2, &["--cron", "never fires"]);
    // 29 February comes.
    let url = migrated(dir.path());
    ok(
        &url,
        &[
            "schedules",
            "add",
            "s",
            "--cron",
            "0 0 29 2 *",
            "--queue",
            "q",
            "--command",
            "true",
        ],
    );
}

/// A file that is not a database was "database error: file is not a database", exit 1,
/// without its path.
#[test]
fn a_file_that_is_not_a_database_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.db");
    std::fs::write(&path, "these are my notes, not a database\n".repeat(100)).unwrap();
    let url = path.display().to_string();
    for args in [&["stats"][..], &["migrate"], &["jobs", "list"]] {
        fails(
            &tenure(&url, args),
            3,
            &["cannot open the SQLite database", &url, "not a database"],
        );
    }
    let before = std::fs::read(&path).unwrap();
    assert!(before.starts_with(b"these are my notes"));
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

/// `schedules list` shows an interval in the largest exact unit, not as given: `--every 24h`
/// is listed as `every 1d`, `--every 60m` as `every 1h`. The library keeps a Duration, not
/// the text; keeping the text needs a column (or accepting "equal to what was given").
#[test]
#[ignore = "schedules keep a Duration: `--every 24h` is listed as `every 1d` (a schema change)"]
fn schedules_list_shows_intervals_exactly_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let url = migrated(dir.path());
    for every in ["24h", "60m"] {
        ok(
            &url,
            &[
                "schedules",
                "add",
                every,
                "--every",
                every,
                "--queue",
                "q",
                "--command",
                "true",
            ],
        );
    }
    let list = ok(&url, &["schedules", "list"]);
    assert!(list.contains("every 24h"), "{list}");
    assert!(list.contains("every 60m"), "{list}");
}

/// A server URL without its scheme (`u:hunter2@localhost/db`) is taken as an SQLite file
/// path, and the error names that path, password included. Refusing `USER:PASS@HOST` paths
/// is a heuristic (such a file name is legal) that the library's URL parsing should own.
#[test]
fn a_url_without_its_scheme_does_not_echo_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .current_dir(dir.path())
        .args(["--database-url", "u:hunter2@localhost/db", "stats"])
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(!stderr(&out).contains("hunter2"), "{}", stderr(&out));
}

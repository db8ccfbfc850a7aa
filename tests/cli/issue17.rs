//! Issue 17's command items, end to end: refusals that enqueue nothing, durations with
//! units, cron errors naming the field, `jobs show` in order with secrets masked, `migrate`
//! stating the schema version, missing SQLite files not created, scheme typos refused,
//! closed pipes survived, and a piped `demo` without carriage returns.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use super::{json, ok, tenure};
use crate::common::{TestDb, conformance};

conformance!(
    jobs_that_cannot_run_are_refused_and_nothing_is_enqueued,
    durations_need_a_unit_and_schedules_show_them_as_given,
    states_retry_and_show_say_what_is_wrong_and_mask_secrets,
    migrate_states_the_schema_version,
    a_closed_stdout_or_stderr_is_not_a_panic
);

/// `tenure` run in `dir`, with `TENURE_DATABASE_URL` and `DATABASE_URL` as given (unset if not).
fn tenure_in(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tenure"));
    command
        .current_dir(dir)
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run tenure")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts exit code 2 and a message holding every one of `words`.
fn refused(out: &Output, words: &[&str]) {
    let text = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    for word in words {
        assert!(text.contains(word), "{word:?} missing from: {text}");
    }
}

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

fn durations_need_a_unit_and_schedules_show_them_as_given(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let add = |name: &str, when: &[&str]| {
        let mut args = vec![
            "schedules",
            "add",
            name,
            "--queue",
            "q",
            "--command",
            "true",
        ];
        args.extend_from_slice(when);
        tenure(url, &args)
    };
    refused(&add("a", &["--every", "5"]), &["--every", "no unit", "5m"]);
    refused(&add("a", &[]), &["--cron", "--every"]);
    refused(
        &add("a", &["--every", "5m", "--cron", "* * * * *"]),
        &["cannot be used with"],
    );
    refused(
        &add("a", &["--cron", "61 * * * *"]),
        &["minute field \"61\"", "0-59", "5 fields"],
    );
    refused(
        &add("a", &["--cron", "0 0 32 * *"]),
        &["day of month field", "1-31"],
    );
    refused(&add("a", &["--cron", "* * *"]), &["3 field(s)", "5 fields"]);
    let out = tenure(url, &["jobs", "prune", "--queue", "q", "--older-than", "7"]);
    refused(&out, &["--older-than", "no unit"]);
    assert_eq!(json(url, &["schedules", "list"]), serde_json::json!([]));

    ok(
        url,
        &[
            "schedules",
            "add",
            "five",
            "--queue",
            "q",
            "--command",
            "true",
            "--every",
            "5m",
        ],
    );
    ok(
        url,
        &[
            "schedules",
            "add",
            "odd",
            "--queue",
            "q",
            "--command",
            "true",
            "--every",
            "90s",
        ],
    );
    let table = ok(url, &["schedules", "list"]);
    assert!(
        table.contains("every 5m") && table.contains("every 90s"),
        "{table}"
    );
    assert!(!table.contains("300s"), "{table}");
}

fn states_retry_and_show_say_what_is_wrong_and_mask_secrets(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    refused(
        &tenure(url, &["jobs", "list", "--state", "finished"]),
        &["waiting", "running", "completed", "dead", "cancelled"],
    );
    let secret = "s3cret-token-value";
    let id = json(
        url,
        &[
            "enqueue",
            "--queue",
            "ops",
            "--command",
            "deploy",
            "--env",
            &format!("TOKEN={secret}"),
            "--env",
            "REGION=eu",
        ],
    )["id"]
        .as_i64()
        .unwrap()
        .to_string();
    let shown = ok(url, &["jobs", "show", &id]);
    for text in [
        shown.clone(),
        ok(url, &["--json", "jobs", "show", &id]),
        ok(url, &["--json", "jobs", "list"]),
    ] {
        assert!(!text.contains(secret), "a secret was printed: {text}");
    }
    assert!(
        shown.contains("TOKEN=•••") && shown.contains("--reveal-env"),
        "{shown}"
    );
    assert!(ok(url, &["jobs", "show", &id, "--reveal-env"]).contains(secret));
    // A stable, meaningful order: id, queue, kind, state, attempts, times, ..., payload.
    let at = |field: &str| {
        shown
            .lines()
            .position(|l| l.trim_start().starts_with(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field} in {shown}"))
    };
    let order = [
        "id", "queue", "kind", "state", "attempts", "created", "due", "command", "env",
    ];
    for pair in order.windows(2) {
        assert!(at(pair[0]) < at(pair[1]), "{pair:?} out of order: {shown}");
    }

    // Retry says why not: no such job, or the job's actual state.
    let out = tenure(url, &["jobs", "retry", "999999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no job 999999"), "{}", stderr(&out));
    let out = tenure(url, &["jobs", "retry", &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("is waiting, not dead"),
        "{}",
        stderr(&out)
    );
    ok(url, &["jobs", "cancel", &id]);
    let out = tenure(url, &["jobs", "retry", &id]);
    assert!(
        stderr(&out).contains("is cancelled, not dead"),
        "{}",
        stderr(&out)
    );
    let out = tenure(url, &["jobs", "cancel", &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("is cancelled"), "{}", stderr(&out));
}

fn migrate_states_the_schema_version(backend: Backend) {
    let db = TestDb::empty(backend);
    let url = db.url();
    let first = ok(url, &["migrate"]);
    let version = tenure::schema_version(&mut db.connect()).unwrap().unwrap();
    assert!(
        first.contains(&format!("schema at version {version}; applied")),
        "{first}"
    );
    let again = ok(url, &["migrate"]);
    assert_eq!(
        again.trim(),
        format!("schema at version {version}; already up to date")
    );
    assert_eq!(json(url, &["migrate"])["version"], version.as_str());
    assert!(ok(url, &["migrate", "--help"]).contains("compare versions"));
}

fn a_closed_stdout_or_stderr_is_not_a_panic(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let batch: Vec<NewJob> = (0..jobs::MAX_BATCH)
        .map(|i| NewJob::new("pipe", "shell", format!("{{\"command\": \"echo {i}\"}}")))
        .collect();
    jobs::enqueue_many(&mut db.connect(), &batch).unwrap();
    // More than a pipe's buffer: tenure is still writing when the reader goes.
    for args in [
        &["--json", "jobs", "list", "--limit", "1000"][..],
        &["jobs", "list", "--limit", "1000"][..],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args(["--database-url", url])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut head = [0u8; 100];
        child.stdout.take().unwrap().read_exact(&mut head).unwrap();
        // The read end is dropped here, like `| head -c 100`.
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    }
    // A closed stderr keeps the failure's own exit code.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["--database-url", url, "jobs", "list", "--state", "nope"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    assert_eq!(child.wait().unwrap().code(), Some(2));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["--database-url", url, "jobs", "show", "999999"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    assert_eq!(child.wait().unwrap().code(), Some(1));
}

/// A read command on an SQLite file that does not exist: exit 4, the file named, nothing
/// created.
#[test]
fn read_commands_do_not_create_a_missing_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["stats"][..],
        &["jobs", "list"],
        &["leases", "list"],
        &["schedules", "list"],
        &["enqueue", "--queue", "q", "--command", "true"],
        &["work", "--queue", "q"],
        &["lease", "run", "nightly", "--", "true"],
    ] {
        let out = tenure_in(dir.path(), &[], args);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", stderr(&out));
        let text = stderr(&out);
        let path = dir.path().join("tenure.db");
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(
            text.contains("tenure migrate") && text.contains("--database-url"),
            "{text}"
        );
        assert!(!path.exists(), "{args:?} created {}", path.display());
    }
    // Bad arguments are refused first (exit 2), still creating nothing.
    refused(
        &tenure_in(dir.path(), &[], &["enqueue", "--queue", "q"]),
        &["needs --command"],
    );
    let out = tenure_in(
        dir.path(),
        &[("TENURE_DATABASE_URL", "other.db")],
        &["stats"],
    );
    assert!(stderr(&out).contains("other.db") && stderr(&out).contains("TENURE_DATABASE_URL"));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // `migrate` creates it, and then the read commands work.
    assert_eq!(
        tenure_in(dir.path(), &[], &["migrate"]).status.code(),
        Some(0)
    );
    assert_eq!(
        tenure_in(dir.path(), &[], &["stats"]).status.code(),
        Some(0)
    );
}

/// A misspelled scheme is refused (not taken as a file name) without echoing a password;
/// an SQLite file that cannot be opened is named.
#[test]
fn scheme_typos_are_refused_and_sqlite_paths_named() {
    let dir = tempfile::tempdir().unwrap();
    for (url, right) in [
        ("postgres//root:pw-9f3@host/db", "postgres://"),
        ("postgresql/db", "postgresql://"),
        ("mysql//root@host/db", "mysql://"),
        ("MySQL:/host/db", "mysql://"),
        ("mariadb//host/db", "mariadb://"),
        ("sqlite//jobs.db", "sqlite://"),
    ] {
        for command in [&["stats"][..], &["migrate"]] {
            let out = tenure_in(
                dir.path(),
                &[],
                &[&["--database-url", url][..], command].concat(),
            );
            refused(&out, &["misspelled scheme", right]);
            assert!(!stderr(&out).contains("pw-9f3"), "{}", stderr(&out));
        }
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "a file was created"
    );
    let missing = dir.path().join("no-such-folder").join("x.db");
    let missing = missing.display().to_string();
    let out = tenure_in(dir.path(), &[], &["--database-url", &missing, "migrate"]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains(&missing), "{}", stderr(&out));
}

/// `demo` to a file: no carriage returns, a word about the tail, where its data is and what
/// to run next; the environment's database URL is left alone, as its help says.
#[test]
fn a_piped_demo_writes_plain_lines_and_says_what_next() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = dir.path().join("production.db").display().to_string();
    let env = [
        ("TENURE_DATABASE_URL", elsewhere.as_str()),
        ("DATABASE_URL", elsewhere.as_str()),
    ];
    let out = tenure_in(
        dir.path(),
        &env,
        &["demo", "--jobs", "200", "--threads", "4"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(!text.contains('\r') && !text.contains('\u{1b}'), "{text:?}");
    assert!(text.contains("jobs done"), "{text}");
    assert!(
        text.contains("retries") && text.contains("delayed reports"),
        "{text}"
    );
    assert!(
        text.contains("tenure --database-url tenure-demo.db stats"),
        "{text}"
    );
    assert!(dir.path().join("tenure-demo.db").exists());
    assert!(
        !Path::new(&elsewhere).exists(),
        "the demo wrote to TENURE_DATABASE_URL"
    );
    let help = tenure_in(dir.path(), &[], &["demo", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("TENURE_DATABASE_URL and DATABASE_URL are ignored"),
        "{help}"
    );
}

//! How secrets are masked at the edges: passwords in a URL's query, holding URL delimiters or
//! only a few characters long; env values given to `--env-from` by mistake, an `env` that is
//! not a map, and a shell payload that does not decode. Found by the attack pass on issue 31's
//! promises (no database password in any error, log or page; a shell job's env values masked
//! everywhere); each test failed on the code before its fix.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::json;
use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::{TestDb, poll_until};
use crate::dashboard::{get, serve};
use crate::{json, tenure};

/// `tenure --database-url URL ARGS...` run in a fresh directory, without the variables.
fn run_with(url: &str, args: &[&str]) -> (Output, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .current_dir(dir.path())
        .arg("--database-url")
        .arg(url)
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let all =
        String::from_utf8_lossy(&[out.stdout.clone(), out.stderr.clone()].concat()).into_owned();
    (out, all)
}

/// Every text the library's errors for `url` show: Display, Debug and the source chain.
fn library_errors(url: &str) -> String {
    let mut shown = String::new();
    let errors = [
        tenure::AnyConnection::connect(url).err(),
        tenure::Pool::options()
            .connection_timeout(Duration::from_secs(2))
            .open(url)
            .err(),
    ];
    for error in errors.into_iter().flatten() {
        shown.push_str(&format!("{error} {error:?}"));
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            shown.push_str(&format!(" {cause} {cause:?}"));
            source = cause.source();
        }
    }
    shown
}

/// Attack: the password in the query, where libpq takes it too (`password=`, `sslpassword=`,
/// and a parameter name percent-encoded, which libpq decodes). `redact` knew only the
/// user-info's password, so libpq's `invalid percent-encoded token: "hunter2%zzsecret"`
/// was printed as is.
#[test]
fn a_password_in_the_query_is_masked() {
    for url in [
        "postgres://root@127.0.0.1:5432/test?password=hunter2%zzsecret",
        "postgres://root@127.0.0.1:5432/test?sslmode=disable&sslpassword=hunter2%zzsecret",
        "postgres://root@127.0.0.1:5432/test?pass%77ord=hunter2%zzsecret",
    ] {
        let (out, all) = run_with(url, &["stats"]);
        assert!(!out.status.success(), "{url}: {all}");
        assert!(!all.contains("hunter2"), "{url} printed: {all}");
        assert!(all.contains("could not connect"), "{url}: says why: {all}");
        let shown = library_errors(url);
        assert!(!shown.contains("hunter2"), "{url}: {shown}");
    }
}

/// Attack: a password holding the URL's own delimiters unencoded. libpq ends the user-info
/// at the first `@` or `/`, so `root:hunter2/secret@...` makes "hunter2" the port (`invalid
/// integer value "hunter2"`) and `root:hunter2@secret@...` makes "secret@127.0.0.1" the host:
/// a piece of the password, which `redact` (masking only the whole password) let through.
#[test]
fn a_password_holding_url_delimiters_is_masked() {
    for url in [
        "postgres://root:hunter2/secret@127.0.0.1:5432/test",
        "postgres://root:hunter2@secret@127.0.0.1:5432/test",
        "postgres://root:hunter2:secret@127.0.0.1:1/test",
        "mysql://root:hunter2/secret@127.0.0.1:3306/test",
        "mysql://root:hunter2@secret@127.0.0.1:3306/test",
        "mysql://root:hunter2?secret@127.0.0.1:3306/test",
        "mysql://root:hunter2#secret@127.0.0.1:3306/test",
    ] {
        for args in [&["stats"][..], &["migrate"][..]] {
            let (out, all) = run_with(url, args);
            assert!(!out.status.success(), "{url} {args:?}: {all}");
            assert!(
                !all.contains("hunter2") && !all.contains("secret"),
                "{url} {args:?} printed: {all}"
            );
        }
        let shown = library_errors(url);
        assert!(
            !shown.contains("hunter2") && !shown.contains("secret"),
            "{url}: {shown}"
        );
    }
}

/// Attack on usefulness: a password of 1-3 characters withheld every message that held its
/// letters anywhere, even inside words: `nn` (in "Connection") turned "Connection refused"
/// into "the driver's message is withheld: it repeats the URL's password", which it did
/// not. A short password the driver does echo as a word of its own is still withheld.
#[test]
fn a_short_password_keeps_the_message_useful_and_masked() {
    let (_, all) = run_with("postgres://root:nn@127.0.0.1:1/test", &["stats"]);
    assert!(all.contains("Connection refused"), "{all}");
    let (_, all) = run_with("mysql://root:nn@127.0.0.1:1/test", &["stats"]);
    assert!(!all.contains("withheld"), "{all}");
    // libpq echoes "ab" as the port: withheld.
    let (out, all) = run_with("postgres://root:ab/c@127.0.0.1:5432/test", &["stats"]);
    assert!(!out.status.success(), "{all}");
    assert!(!all.contains("\"ab\""), "{all}");
    assert!(all.contains("withheld"), "{all}");
}

/// Attack: the demo prints its database URL in its next steps, the password replaced; a
/// `password=` parameter whose name is percent-encoded (`pass%77ord=`, libpq decodes it) and
/// `sslpassword=` were printed as given.
#[test]
fn the_demo_prints_no_password_parameter() {
    let db = TestDb::empty(Backend::Postgres);
    for parameter in ["pass%77ord=hunter2secret", "sslpassword=hunter2secret"] {
        let url = format!("{}?{parameter}", db.url());
        let (out, all) = run_with(&url, &["demo", "--jobs", "100", "--threads", "2"]);
        assert!(out.status.success(), "{all}");
        assert!(all.contains("Look at them with"), "{all}");
        assert!(!all.contains("hunter2"), "{parameter}: {all}");
    }
}

/// Attack: `--env-from TOKEN=s3cr3t` (taken for `--env`) is refused, and the refusal
/// repeated the whole argument, value included.
#[test]
fn an_env_from_with_a_value_is_not_repeated() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("jobs.db").display().to_string();
    crate::ok(&url, &["migrate"]);
    let out = tenure(
        &url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--command",
            "true",
            "--env-from",
            "TOKEN=s3cr3t-value",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("TOKEN"), "names the variable: {stderr}");
    assert!(!stderr.contains("s3cr3t"), "{stderr}");
    // The same name in a payload given as JSON.
    let out = tenure(
        &url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--payload",
            r#"{"command": "true", "env_from": ["TOKEN=s3cr3t-value"]}"#,
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("s3cr3t"), "{stderr}");
}

/// A shell job enqueued through the library (which does not check shell payloads) with
/// `env` as `NAME=VALUE` text instead of a map; its id.
fn shell_job_with_env_text(url: &str) -> i64 {
    let mut conn = tenure::AnyConnection::connect(url).unwrap();
    tenure::run_migrations(&mut conn).unwrap();
    let payload = json!({"command": "true", "env": "TOKEN=s3cr3t-value"});
    jobs::enqueue(&mut conn, &NewJob::json("q", "shell", &payload).unwrap())
        .unwrap()
        .id
}

/// Attack: `mask_env` masked `env` only when it was a map; a shell job whose `env` is text
/// (or a list) showed it in clear in `jobs show`, `--json` and the dashboard.
#[test]
fn an_env_that_is_not_a_map_is_masked() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("jobs.db").display().to_string();
    let id = shell_job_with_env_text(&url).to_string();
    for args in [
        vec!["jobs", "show", &id],
        vec!["--json", "jobs", "show", &id],
        vec!["--json", "jobs", "list"],
    ] {
        let out = tenure(&url, &args);
        assert!(out.status.success(), "{args:?}");
        let all = String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned();
        assert!(!all.contains("s3cr3t"), "{args:?}: {all}");
    }
    let served = serve(&url, &["--read-only"], &[]);
    let page = get(&served.base, &format!("/job?id={id}")).body;
    assert!(!page.contains("s3cr3t"), "{page}");
    assert!(page.contains("•••"), "{page}");
    let revealed = json(&url, &["jobs", "show", &id, "--reveal-env"]);
    assert!(revealed.to_string().contains("s3cr3t"), "{revealed}");
}

/// Attack: the worker decoded shell payloads with the library's `handler`, whose error for
/// an undecodable payload repeats serde's (`invalid type: string "TOKEN=s3cr3t-value",
/// expected a map`): the job's error, shown by `jobs show`, the dashboard and the log.
#[test]
fn an_undecodable_shell_payload_is_not_repeated_in_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("jobs.db").display().to_string();
    let id = shell_job_with_env_text(&url).to_string();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut worker = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["--database-url", &url, "work", "--queue", "q"])
        .args(["--log-format", "json"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    poll_until(Duration::from_secs(60), Duration::from_millis(100), || {
        (json(&url, &["jobs", "show", &id])["state"] == "dead").then_some(())
    })
    .expect("the job did not end dead");
    let _ = worker.kill();
    let _ = worker.wait();
    let shown = json(&url, &["jobs", "show", &id]);
    let error = shown["last_error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("line 1 column"), "says where: {error}");
    assert!(!shown.to_string().contains("s3cr3t"), "{shown}");
    let log = std::fs::read_to_string(log.path()).unwrap();
    assert!(!log.contains("s3cr3t"), "{log}");
    let served = serve(&url, &[], &[]);
    let page = get(&served.base, &format!("/job?id={id}")).body;
    assert!(!page.contains("s3cr3t"), "{page}");
}

//! No secret reaches a person: a shell job's environment values are masked on every page,
//! listing and JSON output (also under `--read-only`), and a database URL's password is in
//! no error, whatever way the URL is malformed and whichever driver refuses it.
//!
//! Found by the first-hour review (issue 31): the dashboard's job page printed
//! `"TOKEN": "s3cr3t-value"`, and libpq's errors repeated malformed URLs, password included.

use std::path::Path;
use std::process::{Command, Output};

use crate::dashboard::{get, serve};
use crate::{json, ok, tenure};

const SECRET: &str = "s3cr3t-value";

/// A migrated SQLite file with one shell job that carries `TOKEN=SECRET`; its id.
fn shell_job_with_a_secret(dir: &std::path::Path) -> (String, String) {
    let url = dir.join("jobs.db").display().to_string();
    ok(&url, &["migrate"]);
    let out = ok(
        &url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--command",
            "echo hi",
            "--env",
            &format!("TOKEN={SECRET}"),
        ],
    );
    let id = out
        .split(|c: char| !c.is_ascii_digit())
        .find(|word| !word.is_empty())
        .expect("the new job's id")
        .to_string();
    (url, id)
}

#[test]
fn the_dashboard_masks_shell_jobs_environment_values() {
    let dir = tempfile::tempdir().unwrap();
    let (url, id) = shell_job_with_a_secret(dir.path());
    for args in [&[][..], &["--read-only"][..]] {
        let served = serve(&url, args, &[]);
        for path in [
            format!("/job?id={id}"),
            "/jobs".to_string(),
            "/".to_string(),
            "/queue?name=q".to_string(),
        ] {
            let answer = get(&served.base, &path);
            assert_eq!(answer.status, 200, "{path}: {}", answer.body);
            assert!(!answer.body.contains(SECRET), "{path} shows the secret");
        }
        let page = get(&served.base, &format!("/job?id={id}")).body;
        assert!(
            page.contains("TOKEN"),
            "the variable's name is shown: {page}"
        );
        assert!(page.contains("•••"), "its value is masked: {page}");
        assert!(!served.log().contains(SECRET), "{}", served.log());
    }
}

#[test]
fn the_command_masks_shell_jobs_environment_values_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (url, id) = shell_job_with_a_secret(dir.path());
    for args in [
        vec!["jobs", "show", &id],
        vec!["--json", "jobs", "show", &id],
        vec!["jobs", "list"],
        vec!["--json", "jobs", "list"],
        vec!["--json", "stats"],
    ] {
        let out = tenure(&url, &args);
        assert!(out.status.success(), "{args:?}");
        let all = [out.stdout, out.stderr].concat();
        assert!(!String::from_utf8_lossy(&all).contains(SECRET), "{args:?}");
    }
    let revealed = json(&url, &["jobs", "show", &id, "--reveal-env"]);
    assert!(revealed.to_string().contains(SECRET), "{revealed}");
}

/// Malformed and refused URLs, each with the password `hunter2secret` (or its parts).
const URLS: &[&str] = &[
    // bad host
    "postgres://root:hunter2secret@[bad",
    "mysql://root:hunter2secret@[bad",
    "postgresql://root:hunter2secret@[::1/test",
    // bad port
    "postgres://root:hunter2secret@127.0.0.1:notaport/test",
    "mysql://root:hunter2secret@127.0.0.1:notaport/test",
    "postgres://root:hunter2secret@127.0.0.1:99999/test",
    // bad percent-encoding
    "postgres://root:hunter2%zzsecret@127.0.0.1:5432/test",
    "mysql://root:hunter2%zzsecret@127.0.0.1:3306/test",
    "postgres://root:hunter2%41secret@[bad",
    // no scheme
    "root:hunter2secret@127.0.0.1/test",
    "root:hunter2secret@127.0.0.1:5432/test",
    // unknown scheme, or a password where a scheme should be
    "ftp://root:hunter2secret@127.0.0.1/test",
    "root:hunter2secret@host://x",
    // the drivers' own refusals: nothing listens, no such user, a NUL byte
    "postgres://root:hunter2secret@127.0.0.1:1/test",
    "mysql://root:hunter2secret@127.0.0.1:1/test",
    "postgres://nosuchuser:hunter2secret@127.0.0.1:5432/test",
    "mysql://nosuchuser:hunter2secret@127.0.0.1:3306/test",
    "postgres://root:hunter2secret@127.0.0.1:5432/test\0",
    "mysql://root:hunter2secret@127.0.0.1:3306/test?ssl_mode=bogus",
];

/// What of `hunter2secret` must never appear: the password, and its two halves around a
/// bad escape.
fn leaks(text: &str) -> bool {
    text.contains("hunter2")
}

#[test]
fn no_malformed_url_prints_its_password() {
    let dir = tempfile::tempdir().unwrap();
    for url in URLS {
        if url.contains('\0') {
            continue; // an argument cannot hold a NUL: the library test feeds it in
        }
        for args in [
            &["stats"][..],
            &["work", "--log-format", "json", "--queue", "q"][..],
            &["migrate"][..],
            &["work", "--queue", "q"][..],
        ] {
            // Given as a flag, and as the environment variable.
            let flag = Command::new(env!("CARGO_BIN_EXE_tenure"))
                .current_dir(dir.path())
                .arg("--database-url")
                .arg(url)
                .args(args)
                .env_remove("TENURE_DATABASE_URL")
                .env_remove("DATABASE_URL")
                .output()
                .unwrap();
            let from_env = Command::new(env!("CARGO_BIN_EXE_tenure"))
                .current_dir(dir.path())
                .args(args)
                .env("TENURE_DATABASE_URL", url)
                .env_remove("DATABASE_URL")
                .output()
                .unwrap();
            for out in [flag, from_env] {
                let all = String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned();
                assert!(!out.status.success(), "{url} {args:?}: {all}");
                assert!(!leaks(&all), "{url} {args:?} printed: {all}");
                assert!(!all.trim().is_empty(), "{url} {args:?}: says why");
            }
        }
    }
    // Nothing was created for any of them.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn no_library_error_shows_the_password() {
    for url in URLS {
        let errors = [
            tenure::AnyConnection::connect(url).err(),
            tenure::AnyConnection::connect_raw(url).err(),
            tenure::Pool::options()
                .connection_timeout(std::time::Duration::from_secs(2))
                .open(url)
                .err(),
        ];
        for error in errors.into_iter().flatten() {
            let mut shown = format!("{error} {error:?}");
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                shown.push_str(&format!(" {cause} {cause:?}"));
                source = cause.source();
            }
            assert!(!leaks(&shown), "{url}: {shown}");
        }
    }
}

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

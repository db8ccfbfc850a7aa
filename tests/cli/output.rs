//! The command's output: a closed stdout or stderr is not a panic, and a piped `demo` writes
//! plain lines and says what to do next.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::{TestDb, conformance};

conformance!(a_closed_stdout_or_stderr_is_not_a_panic,);

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

// From issue 17's command items, end to end (cli/issue17.rs).
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

// From issue 17's command items, end to end (cli/issue17.rs).
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

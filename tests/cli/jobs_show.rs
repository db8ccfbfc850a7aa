//! `tenure jobs show`, `states` and `retry`: what is wrong is said, in order, with secrets masked.

use std::process::Output;

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::{json, ok, tenure};

conformance!(states_retry_and_show_say_what_is_wrong_and_mask_secrets,);

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

// From issue 17's command items, end to end (cli/issue17.rs).
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

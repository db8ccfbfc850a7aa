//! `tenure schedules` from the command: durations need a unit and are shown as given, a cron
//! that never fires is refused first.

use std::path::Path;
use std::process::Output;

use tenure::Backend;

use crate::common::{TestDb, conformance};
use crate::{json, ok, tenure};

conformance!(durations_need_a_unit_and_schedules_show_them_as_given,);

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

// `--every 24h` was once listed as `every 1d`. Chosen: a schedule keeps a
// Duration, not the text it was given, and the list shows it in the largest exact unit (an
// equal interval, never a rounded one); keeping the text would need a column for nothing the
// schedule does.
/// `schedules list` shows an interval equal to the one given, in its largest exact unit:
/// `--every 24h` as `every 1d`, `--every 60m` as `every 1h`, `--every 90m` as `every 90m`.
#[test]
fn schedules_list_shows_intervals_equal_to_those_given_in_their_largest_exact_unit() {
    let dir = tempfile::tempdir().unwrap();
    let url = migrated(dir.path());
    for (name, every) in [("a", "24h"), ("b", "60m"), ("c", "90m")] {
        ok(
            &url,
            &[
                "schedules",
                "add",
                name,
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
    for shown in ["every 1d", "every 1h", "every 90m"] {
        assert!(list.contains(shown), "{shown:?} missing from: {list}");
    }
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

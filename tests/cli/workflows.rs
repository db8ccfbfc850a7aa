//! `tenure workflows` and what `tenure jobs show` says of jobs in workflows: the tree with its
//! states, progress and results, cancelling a whole workflow, hostile stored text printed
//! harmlessly, and a big batch shown within bounds.

use std::time::Duration;

use serde_json::{Value, json};
use tenure::Backend;
use tenure::jobs::{self, EnqueuedWorkflow, JobResult, NewJob, Workflow};

use super::{json, ok, queue_figure, tenure};
use crate::common::{TestDb, conformance};

conformance!(
    show_draws_a_diamond_with_states_progress_and_results,
    cancel_stops_a_whole_workflow,
    hostile_kinds_names_and_results_print_harmlessly,
    a_batch_of_a_thousand_jobs_shows_within_bounds
);

const MINUTE: Duration = Duration::from_secs(60);

/// A→{B,C}→D with the three callbacks; B and C on queues of their own, so that a test
/// claims the one it means.
fn diamond(conn: &mut tenure::AnyConnection) -> EnqueuedWorkflow {
    let mut etl = Workflow::new("nightly-etl");
    let a = etl.add(NewJob::new("etl", "fetch", vec![]));
    let b = etl.add_after(&[a], NewJob::new("etl-b", "clean", vec![]));
    let c = etl.add_after(&[a], NewJob::new("etl-c", "enrich", vec![]));
    etl.add_after(&[b, c], NewJob::new("etl", "merge", vec![]));
    etl.on_success(NewJob::new("etl", "notify", vec![]));
    etl.on_failure(NewJob::new("etl", "page-someone", vec![]));
    etl.on_finish(NewJob::new("etl", "cleanup", vec![]));
    jobs::enqueue_workflow(conn, &etl).unwrap()
}

fn job_in(shown: &Value, id: i64) -> &Value {
    shown["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == id)
        .unwrap_or_else(|| panic!("job {id} missing from {shown}"))
}

fn has_all(text: &str, lines: &[String]) {
    for line in lines {
        assert!(
            text.contains(line.as_str()),
            "{line:?} missing from:\n{text}"
        );
    }
}

fn show_draws_a_diamond_with_states_progress_and_results(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let w = diamond(&mut conn);
    let (wid, [a, b, c, d]) = (w.id, <[i64; 4]>::try_from(w.jobs.clone()).unwrap());
    let (success, failure, finish) = (
        w.on_success.unwrap(),
        w.on_failure.unwrap(),
        w.on_finish.unwrap(),
    );
    let text = ok(url, &["workflows", "show", &wid.to_string()]);
    has_all(
        &text,
        &[
            format!("workflow {wid} \"nightly-etl\", created "),
            "4 step(s): 1 waiting, 3 blocked".into(),
            format!("\n#{a} fetch waiting\n"),
            format!("\n├─ #{b} clean blocked [all_completed]\n"),
            format!("\n│  └─ #{d} merge blocked [all_completed]\n"),
            format!("\n└─ #{c} enrich blocked [all_completed]\n"),
            format!("\n   └─ #{d} merge (see above)\n"),
            "\ncallbacks:\n".into(),
            format!("on success  #{success} notify blocked"),
            format!("on failure  #{failure} page-someone blocked"),
            format!("on finish   #{finish} cleanup blocked"),
        ],
    );
    // The tree in order: A, B under it, D under B, C, D's reference under C.
    let at = |needle: String| text.find(&needle).unwrap();
    assert!(at(format!("#{a} fetch")) < at(format!("#{b} clean")));
    assert!(at(format!("#{b} clean")) < at(format!("#{d} merge blocked")));
    assert!(at(format!("#{d} merge blocked")) < at(format!("#{c} enrich")));
    assert!(at(format!("#{c} enrich")) < at(format!("#{d} merge (see above)")));
    assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");

    let shown = json(url, &["workflows", "show", &wid.to_string()]);
    assert_eq!(shown["id"], wid);
    assert_eq!(shown["name"], "nightly-etl");
    assert_eq!(shown["steps"], 4);
    assert_eq!(shown["counts"]["waiting"], 1);
    assert_eq!(shown["counts"]["blocked"], 3);
    assert_eq!(
        shown["on_success"],
        json!({"id": success, "state": "blocked"})
    );
    assert_eq!(shown["jobs"].as_array().unwrap().len(), 7);
    assert_eq!(job_in(&shown, d)["dependencies"], json!([b, c]));
    assert_eq!(job_in(&shown, d)["run_when"], "all_completed");
    assert_eq!(job_in(&shown, a)["dependencies"], json!([]));
    assert_eq!(job_in(&shown, failure)["callback"], "on_failure");
    assert_eq!(job_in(&shown, failure)["run_when"], "any_failed");
    assert_eq!(job_in(&shown, finish)["dependencies"], json!([a, b, c, d]));

    // A completes with a result; B runs and says how far it is.
    let fetch = jobs::claim(&mut conn, "etl", 1, MINUTE).unwrap().remove(0);
    assert_eq!(fetch.id, a);
    let result = JobResult::json(&json!({"rows": 42, "files": ["a.csv", "b.csv"]})).unwrap();
    jobs::complete_with_result(&mut conn, fetch.claim(), &result).unwrap();
    let clean = jobs::claim(&mut conn, "etl-b", 1, MINUTE)
        .unwrap()
        .remove(0);
    jobs::record_progress(&mut conn, clean.claim(), 0.42, "half way").unwrap();
    let text = ok(url, &["workflows", "show", &wid.to_string()]);
    has_all(
        &text,
        &[
            "4 step(s): 1 completed, 1 running, 1 waiting, 1 blocked".into(),
            format!("\n#{a} fetch completed\n"),
            format!("├─ #{b} clean running 42% [all_completed]"),
            format!("└─ #{c} enrich waiting [all_completed]"),
        ],
    );
    let shown = json(url, &["workflows", "show", &wid.to_string()]);
    assert_eq!(job_in(&shown, b)["progress"].as_f64(), Some(0.42));
    assert_eq!(shown["counts"]["completed"], 1);
    let listed = json(url, &["workflows", "list"]);
    assert_eq!(listed[0]["id"], wid);
    assert_eq!(listed[0]["counts"]["running"], 1);
    assert!(ok(url, &["workflows", "list"]).contains("nightly-etl"));

    // `jobs show`: the workflow, what D waits for, B's progress, A's result.
    let text = ok(url, &["jobs", "show", &d.to_string()]);
    has_all(
        &text,
        &[
            format!("workflow: {wid} (nightly-etl)"),
            "run when: all_completed".into(),
            format!("waits for: #{b} running, #{c} waiting"),
        ],
    );
    assert!(!text.contains("result"), "{text}");
    let text = ok(url, &["jobs", "show", &b.to_string()]);
    has_all(&text, &["progress: 42% half way".into()]);
    let text = ok(url, &["jobs", "show", &a.to_string()]);
    has_all(
        &text,
        &[
            "result (json, ".into(),
            "\"rows\": 42".into(),
            "  \"files\": [\n    \"a.csv\",".into(),
        ],
    );
    assert!(!text.contains("waits for"), "{text}");
    let value = json(url, &["jobs", "show", &d.to_string()]);
    assert_eq!(value["workflow_id"], wid);
    assert_eq!(value["workflow_name"], "nightly-etl");
    assert_eq!(value["run_when"], "all_completed");
    assert_eq!(
        value["waits_for"],
        json!([{"id": b, "state": "running"}, {"id": c, "state": "waiting"}])
    );
    assert_eq!(value["result"], Value::Null);
    let value = json(url, &["jobs", "show", &a.to_string()]);
    assert_eq!(value["result"]["format"], "json");
    assert_eq!(value["result"]["value"]["rows"], 42);
    let value = json(url, &["jobs", "show", &b.to_string()]);
    assert_eq!(value["progress"].as_f64(), Some(0.42));
    assert_eq!(value["progress_message"], "half way");
    // Blocked jobs are a state of their own in `stats` and `jobs list`.
    assert_eq!(queue_figure(url, "etl", "blocked"), 4);
    let blocked = json(url, &["jobs", "list", "--state", "blocked"]);
    assert_eq!(blocked.as_array().unwrap().len(), 4, "{blocked}");
    assert!(ok(url, &["stats"]).contains("blocked"));
}

fn cancel_stops_a_whole_workflow(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let w = diamond(&mut conn);
    let running = jobs::claim(&mut conn, "etl", 1, MINUTE).unwrap().remove(0);
    assert_eq!(running.id, w.jobs[0]);
    let text = ok(url, &["workflows", "cancel", &w.id.to_string()]);
    assert!(text.contains("cancelled or, if running, asked"), "{text}");
    let value = json(url, &["workflows", "show", &w.id.to_string()]);
    let counts = &value["counts"];
    assert_eq!(
        (counts["blocked"].as_i64(), counts["waiting"].as_i64()),
        (Some(0), Some(0)),
        "{value}"
    );
    // The running job was asked; everything else is cancelled, callbacks included.
    assert_eq!(counts["running"], 1);
    assert_eq!(counts["cancelled"], 3);
    for when in ["on_success", "on_failure", "on_finish"] {
        assert_eq!(value[when]["state"], "cancelled", "{value}");
    }
    for queue in ["etl", "etl-b", "etl-c"] {
        assert!(
            jobs::claim(&mut conn, queue, 10, MINUTE)
                .unwrap()
                .is_empty()
        );
    }
    // Again: nothing left (the running job was asked already), not an error.
    let again = json(url, &["workflows", "cancel", &w.id.to_string()]);
    assert_eq!(again, json!({"workflow": w.id, "cancelled": 0}));
    assert!(ok(url, &["workflows", "cancel", &w.id.to_string()]).contains("nothing left"));
    // No such workflow: exit code 1, for cancel and show.
    for command in ["cancel", "show"] {
        let out = tenure(url, &["workflows", command, "999999"]);
        assert_eq!(out.status.code(), Some(1), "{command}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("no workflow 999999"));
    }
}

/// Bytes a terminal would act on: escapes (OSC title, clear screen, colours), BEL, a C1 CSI
/// and a right-to-left override.
const HOSTILE: &str =
    "x\u{1b}]0;pwned\u{7}\u{1b}[2J\u{1b}[31m\u{9b}1m\u{202e}<script>alert(1)</script>";

fn assert_harmless(out: &[u8], what: &str) {
    let text = String::from_utf8_lossy(out);
    for bad in ['\u{1b}', '\u{7}', '\u{9b}', '\u{202e}'] {
        assert!(!text.contains(bad), "{what}: {bad:?} printed raw:\n{text}");
    }
}

fn hostile_kinds_names_and_results_print_harmlessly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let mut w = Workflow::new(HOSTILE);
    let first = w.add(NewJob::new("evil", HOSTILE, vec![]));
    w.add_after(&[first], NewJob::new("evil", HOSTILE, vec![]));
    w.add(NewJob::new("evil-bytes", "raw", vec![]));
    w.on_finish(NewJob::new("evil", HOSTILE, vec![]));
    let w = jobs::enqueue_workflow(&mut conn, &w).unwrap();
    let job = jobs::claim(&mut conn, "evil", 1, MINUTE).unwrap().remove(0);
    let result = JobResult::json(&json!({"html": HOSTILE, HOSTILE: [HOSTILE]})).unwrap();
    jobs::complete_with_result(&mut conn, job.claim(), &result).unwrap();
    let raw = jobs::claim(&mut conn, "evil-bytes", 1, MINUTE)
        .unwrap()
        .remove(0);
    jobs::complete_with_result(
        &mut conn,
        raw.claim(),
        &JobResult::bytes(HOSTILE.as_bytes().to_vec()).unwrap(),
    )
    .unwrap();
    let second = w.jobs[1];
    let wid = w.id.to_string();
    let (job_id, raw_id, second) = (job.id.to_string(), raw.id.to_string(), second.to_string());
    // Whether the text shows the hostile text (escaped) in full, at least once.
    for (args, shown_whole) in [
        (vec!["workflows", "show", &wid], false),
        (vec!["workflows", "list"], false),
        (vec!["jobs", "show", &job_id], true),
        (vec!["jobs", "show", &raw_id], false),
        (vec!["jobs", "show", &second], true),
        (vec!["jobs", "list"], true),
        (vec!["stats"], false),
    ] {
        for json_flag in [false, true] {
            let mut all = if json_flag { vec!["--json"] } else { vec![] };
            all.extend(args.iter().copied());
            let out = tenure(url, &all);
            assert!(out.status.success(), "{all:?}");
            assert_harmless(&out.stdout, &format!("{all:?}"));
            let text = String::from_utf8(out.stdout).unwrap();
            if json_flag {
                // The JSON carries the text exactly, escaped.
                let _: Value = serde_json::from_str(&text).unwrap();
            } else if shown_whole {
                // The text shows it, escaped, markup as plain text.
                assert!(text.contains("\\u{1b}]0;pwned\\u{7}"), "{all:?}:\n{text}");
                assert!(
                    text.contains("<script>alert(1)</script>"),
                    "{all:?}:\n{text}"
                );
            }
        }
    }
    let value = json(url, &["workflows", "show", &wid]);
    assert_eq!(value["name"], HOSTILE);
    assert_eq!(job_in(&value, job.id)["kind"], HOSTILE);
    let value = json(url, &["jobs", "show", &job.id.to_string()]);
    assert_eq!(value["kind"], HOSTILE);
    assert_eq!(value["result"]["value"]["html"], HOSTILE);
    // Bytes: the length and the leading bytes in hex; --json gives them all in hex.
    let text = ok(url, &["jobs", "show", &raw.id.to_string()]);
    let hex: String = HOSTILE.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(
        text.contains(&format!(
            "result: {} bytes, in hex {}…",
            HOSTILE.len(),
            &hex[..32]
        )),
        "{text}"
    );
    let value = json(url, &["jobs", "show", &raw.id.to_string()]);
    assert_eq!(
        value["result"],
        json!({"format": "bytes", "length": HOSTILE.len(), "hex": hex})
    );
}

fn a_batch_of_a_thousand_jobs_shows_within_bounds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let mut batch = Workflow::new("resize-all");
    for i in 0..1000 {
        batch.add(NewJob::json("img", "resize", &i).unwrap());
    }
    batch.on_finish(NewJob::new("img", "report", vec![]));
    let w = jobs::enqueue_workflow(&mut conn, &batch).unwrap();
    // A result larger than the text shows.
    let big: Vec<String> = (0..400).map(|i| format!("thumbnail-{i}.png")).collect();
    let job = jobs::claim(&mut conn, "img", 1, MINUTE).unwrap().remove(0);
    jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json(&big).unwrap()).unwrap();

    let text = ok(url, &["workflows", "show", &w.id.to_string()]);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() < 215, "{} lines", lines.len());
    has_all(
        &text,
        &[
            "1000 step(s): 1 completed, 999 waiting".into(),
            "\n… 800 more jobs".into(),
            format!("on finish   #{} report blocked", w.on_finish.unwrap()),
        ],
    );
    let value = json(url, &["workflows", "show", &w.id.to_string()]);
    assert_eq!(value["jobs"].as_array().unwrap().len(), 1001);

    // The callback waits for all 1,000: 20 named, the rest counted.
    let report = w.on_finish.unwrap().to_string();
    let text = ok(url, &["jobs", "show", &report]);
    assert!(text.contains("and 980 more"), "{text}");
    assert!(
        text.contains(&format!("waits for: #{} ", w.jobs[0])),
        "{text}"
    );
    assert!(text.lines().count() < 40, "{text}");
    let value = json(url, &["jobs", "show", &report]);
    assert_eq!(value["waits_for"].as_array().unwrap().len(), 1000);
    // The big result is cut in the text, whole in the JSON.
    let text = ok(url, &["jobs", "show", &job.id.to_string()]);
    assert!(text.contains("… (cut: the first"), "{text}");
    assert!(text.len() < 4000, "{} bytes", text.len());
    let value = json(url, &["jobs", "show", &job.id.to_string()]);
    assert_eq!(value["result"]["value"].as_array().unwrap().len(), 400);
    assert_eq!(queue_figure(url, "img", "blocked"), 1);
}

//! A job's completed steps in `tenure jobs show` (text and `--json`) and on the dashboard's
//! job page: name, when, size and the start of the result, markup escaped.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::{TestDb, conformance};
use crate::dashboard::{get, serve};
use crate::{json, ok};

conformance!(a_jobs_steps_are_shown_by_the_command_and_the_dashboard,);

fn a_jobs_steps_are_shown_by_the_command_and_the_dashboard(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let claim = jobs::claim(&mut conn, "q", 1, Duration::from_secs(60))
        .unwrap()
        .remove(0)
        .claim();
    let step = |conn: &mut tenure::AnyConnection, name: &str, value: serde_json::Value| {
        jobs::run_step(conn, claim, name, |_| Ok::<_, String>(value)).unwrap();
    };
    step(&mut conn, "fetch", serde_json::json!({"rows": 3}));
    step(
        &mut conn,
        "<b>upload</b>",
        serde_json::json!("s3://bucket/<key>"),
    );
    let id_text = id.to_string();

    let shown = ok(db.url(), &["jobs", "show", &id_text]);
    assert!(shown.contains("step fetch done at"), "{shown}");
    assert!(shown.contains("(10 bytes): {\"rows\":3}"), "{shown}");
    assert!(shown.contains("step <b>upload</b> done at"), "{shown}");
    let value = json(db.url(), &["jobs", "show", &id_text]);
    let steps = value["steps"].as_array().expect("steps in --json");
    assert_eq!(steps.len(), 2, "{value}");
    assert_eq!(steps[0]["name"], "fetch");
    assert_eq!(steps[0]["result"]["rows"], 3);
    assert_eq!(steps[0]["bytes"], 10);

    let served = serve(db.url(), &[], &[]);
    let page = get(&served.base, &format!("/job?id={id}"));
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains("<h2>Steps</h2>"), "{}", page.body);
    assert!(page.body.contains("fetch"), "{}", page.body);
    assert!(
        page.body.contains("&lt;b&gt;upload&lt;/b&gt;"),
        "{}",
        page.body
    );
    assert!(
        !page.body.contains("<b>upload"),
        "markup unescaped: {}",
        page.body
    );
}

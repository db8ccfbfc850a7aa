//! Flow control from the command: a queue-wide limit set and cleared, and `stats` showing
//! it with the limit keys that are saturated or throttled, and when they free up.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use super::{json, ok};
use crate::common::{TestDb, conformance};

conformance!(
    stats_show_queue_limits_and_busy_keys,
    jobs_show_gives_limits_and_dedup_windows
);

fn stats_show_queue_limits_and_busy_keys(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let set = ok(url, &["jobs", "limit-queue", "reports", "2"]);
    assert!(set.contains("at most 2 running"), "{set}");
    jobs::enqueue(
        &mut conn,
        &NewJob::new("reports", "render", vec![]).limit("acct:1", 1),
    )
    .unwrap();
    let hour = Duration::from_secs(3600);
    jobs::enqueue(
        &mut conn,
        &NewJob::new("hooks", "deliver", vec![]).rate_limit("cust:9", 1, hour),
    )
    .unwrap();
    jobs::enqueue(
        &mut conn,
        &NewJob::new("hooks", "deliver", vec![]).rate_limit("cust:9", 1, hour),
    )
    .unwrap();
    assert_eq!(jobs::claim(&mut conn, "reports", 5, hour).unwrap().len(), 1);
    assert_eq!(jobs::claim(&mut conn, "hooks", 5, hour).unwrap().len(), 1);
    let text = ok(url, &["stats"]);
    for words in [
        "2 running",
        "acct:1",
        "saturated",
        "cust:9",
        "throttled",
        "59m",
    ] {
        assert!(text.contains(words), "{words:?} missing from:\n{text}");
    }
    let value = json(url, &["stats"]);
    let keys = value["limit_keys"].as_array().expect("limit_keys");
    let acct = keys.iter().find(|k| k["key"] == "acct:1").expect("acct:1");
    assert_eq!(
        (acct["running"].as_i64(), acct["saturated"].as_bool()),
        (Some(1), Some(true))
    );
    let cust = keys.iter().find(|k| k["key"] == "cust:9").expect("cust:9");
    assert!(cust["throttled_until"].is_string(), "{cust}");
    let reports = value["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == "reports");
    assert_eq!(reports.unwrap()["max_running"].as_u64(), Some(2));
    let cleared = ok(url, &["jobs", "limit-queue", "reports", "--clear"]);
    assert!(cleared.contains("no limit"), "{cleared}");
    assert!(jobs::queue_limits(&mut conn).unwrap().is_empty());
    // A cap out of range is refused with the usage, and changes nothing.
    let out = super::tenure(url, &["jobs", "limit-queue", "reports", "0"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(jobs::queue_limits(&mut conn).unwrap().is_empty());
}

/// `jobs show` names a job's limits and its dedup window (and, once it finished, until when
/// it folds duplicates).
fn jobs_show_gives_limits_and_dedup_windows(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let job = NewJob::new("hooks", "deliver", vec![])
        .dedup_key("evt_1")
        .dedup_window(Duration::from_secs(3600), jobs::DedupOver::Completed)
        .limit("cust:9", 2)
        .rate_limit("cust:9", 10, Duration::from_secs(60));
    let id = jobs::enqueue(&mut conn, &job).unwrap().id;
    let claimed = jobs::claim(&mut conn, "hooks", 1, Duration::from_secs(60)).unwrap();
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    let text = ok(url, &["jobs", "show", &id.to_string()]);
    for words in [
        "cust:9: at most 2 running, at most 10 starts per 1m00s",
        "dedup window: 1h00m (folds duplicates until",
    ] {
        assert!(text.contains(words), "{words:?} missing from:\n{text}");
    }
    let value = json(url, &["jobs", "show", &id.to_string()]);
    assert_eq!(value["dedup_window_seconds"].as_f64(), Some(3600.0));
    assert_eq!(value["limits"][0]["rate_max"].as_u64(), Some(10));
}

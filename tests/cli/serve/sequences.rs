//! The dashboard's job page for a sequence: the key, the job a blocked one waits for, a dead
//! job that holds the rest back, and the action that lets the sequence go on.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob, Retry};

use super::{location, state};
use crate::common::{TestDb, conformance};
use crate::dashboard::{csrf, get, post, serve};

conformance!(a_sequences_head_and_what_holds_it_are_shown_and_can_be_let_go,);

fn a_sequences_head_and_what_holds_it_are_shown_and_can_be_let_go(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("sync", "pull", vec![]).sequence("device-9");
    let first = jobs::enqueue(&mut conn, &job()).unwrap().id;
    let second = jobs::enqueue(&mut conn, &job()).unwrap().id;
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let page = get(base, &format!("/job?id={second}"));
    assert!(page.body.contains("device-9"), "{}", page.body);
    assert!(
        page.body.contains(&format!(
            "after <a href=\"/job?id={first}\">#{first}</a> (waiting)"
        )),
        "{}",
        page.body
    );
    let claimed = jobs::claim(&mut conn, "sync", 10, Duration::from_secs(60)).unwrap();
    jobs::fail(&mut conn, claimed[0].claim(), "broken", Retry::Never).unwrap();
    let page = get(base, &format!("/job?id={second}"));
    assert!(
        page.body.contains(&format!(
            "held by <a href=\"/job?id={first}\">#{first}</a> (dead)"
        )),
        "{}",
        page.body
    );
    let dead_page = get(base, &format!("/job?id={first}"));
    assert!(
        dead_page
            .body
            .contains("holds the rest of its sequence back"),
        "{}",
        dead_page.body
    );
    assert!(
        dead_page.body.contains("Let the sequence go on"),
        "{}",
        dead_page.body
    );
    let token = csrf(&dead_page.body);
    let id = first.to_string();
    let done = post(
        base,
        "/job/skip-in-sequence",
        &[("csrf", token.as_str()), ("id", id.as_str())],
    );
    assert_eq!(
        location(&done),
        format!("/job?id={first}&done=sequence-goes-on")
    );
    assert_eq!(state(&mut conn, second), JobState::Waiting);
    let again = post(
        base,
        "/job/skip-in-sequence",
        &[("csrf", token.as_str()), ("id", id.as_str())],
    );
    assert_eq!(
        location(&again),
        format!("/job?id={first}&done=not-holding")
    );
    assert!(
        !get(base, &format!("/job?id={first}"))
            .body
            .contains("Let the sequence go on")
    );
}

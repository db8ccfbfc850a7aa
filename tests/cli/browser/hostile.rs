//! Hostile input in headless Chromium (SQLite): stored markup renders as text on every page,
//! and a forged form without its CSRF token is refused (with the page's token it goes
//! through).

use std::time::Duration;

use serde_json::json;
use tenure::jobs::{self, JobState, NewJob};

use super::{Scene, dead, state};
use crate::common::poll_until;
use crate::webdriver::DEADLINE;

const SCRIPT: &str = "<script>window.__pwned=1</script>";
const IMG: &str = "\"><img src=x onerror=\"window.__pwned=1\">";

#[test]
fn hostile_text_renders_as_text() {
    let (scene, id) = Scene::new(|conn| {
        let hostile_queue = format!("q{IMG}");
        jobs::enqueue(conn, &NewJob::new(hostile_queue, "k", vec![])).unwrap();
        dead(
            conn,
            NewJob::new("inbox", SCRIPT, format!("{SCRIPT}{IMG}").into_bytes()),
            &format!("{IMG} then {SCRIPT}\n{SCRIPT}"),
        )
    });
    // Each page, and a hostile text it must show literally.
    let pages = [
        (format!("/job?id={id}"), "<script>"),
        ("/jobs".to_string(), "<script>"),
        ("/".to_string(), "<img src=x"),
        (format!("/jobs?kind={}", urlencode(SCRIPT)), "<script>"),
    ];
    for (path, literal) in &pages {
        scene.open(path);
        let untouched = scene
            .browser
            .execute("return window.__pwned === undefined", json!([]));
        assert_eq!(untouched, json!(true), "{path} ran injected script");
        assert!(
            scene.browser.find_all("img[src=x]").is_empty(),
            "{path} has an injected <img>"
        );
        let text = scene.browser.page_text();
        assert!(
            text.contains(literal),
            "{path} does not show {literal}:\n{text}"
        );
    }
    // The job page shows each hostile text whole, where it belongs.
    scene.open(&format!("/job?id={id}"));
    let fields = scene.browser.text(&scene.browser.find("#job-fields"));
    assert!(fields.contains(SCRIPT), "{fields}");
    let payload = scene.browser.text(&scene.browser.find("#payload"));
    assert!(payload.contains(&format!("{SCRIPT}{IMG}")), "{payload}");
    let errors = scene.browser.text(&scene.browser.find("#errors"));
    assert!(errors.contains(&format!("{IMG} then {SCRIPT}")), "{errors}");
    // The hostile queue's link leads to its page.
    scene.open("/");
    let link = scene.browser.find("#queues tr[data-queue^=q] a");
    scene.browser.click(&link);
    scene
        .browser
        .wait_for_url("the queue's page", |url| url.contains("/queue?name=q"));
    assert_eq!(
        scene.browser.text(&scene.browser.find("main h1")),
        format!("Queue q{IMG}")
    );
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Builds and submits a POST form to `action` with `fields` from the page (as a forged page
/// would, minus the cross-site headers), and waits for the answer's page.
fn submit(scene: &Scene, action: &str, fields: serde_json::Value) {
    scene.browser.execute(
        "var form = document.createElement('form');
         form.method = 'post';
         form.action = arguments[0];
         for (var name in arguments[1]) {
           var input = document.createElement('input');
           input.type = 'hidden';
           input.name = name;
           input.value = arguments[1][name];
           form.appendChild(input);
         }
         document.body.appendChild(form);
         form.submit();",
        json!([action, fields]),
    );
}

/// The HTTP status of the page now shown, once it is the answer to a POST to `action`.
fn answered_status(scene: &Scene, action: &str) -> i64 {
    scene
        .browser
        .wait_for_url(action, |url| url.ends_with(action));
    poll_until(DEADLINE, Duration::from_millis(50), || {
        let status = scene.browser.execute(
            "var nav = performance.getEntriesByType('navigation')[0];
             return document.readyState === 'complete' && nav ? nav.responseStatus : 0;",
            json!([]),
        );
        status.as_i64().filter(|status| *status != 0)
    })
    .unwrap_or_else(|| panic!("no answer to the POST to {action}"))
}

#[test]
fn a_post_without_its_csrf_token_is_refused() {
    let (scene, id) = Scene::new(|conn| {
        jobs::enqueue(conn, &NewJob::new("mail", "welcome", vec![]))
            .unwrap()
            .id
    });
    scene.open(&format!("/job?id={id}"));
    submit(&scene, "/job/cancel", json!({ "id": id.to_string() }));
    assert_eq!(answered_status(&scene, "/job/cancel"), 403);
    let text = scene.browser.page_text();
    assert!(text.contains("CSRF"), "{text}");
    let job = jobs::get(&mut scene.conn(), id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Waiting);
    assert!(job.cancel_requested_at.is_none());

    scene.open("/queue?name=mail");
    submit(&scene, "/queue/pause", json!({ "name": "mail" }));
    assert_eq!(answered_status(&scene, "/queue/pause"), 403);
    assert!(!jobs::is_paused(&mut scene.conn(), "mail").unwrap());

    // The same forged form with the page's token goes through: the token alone made the
    // difference.
    scene.open(&format!("/job?id={id}"));
    let token = scene
        .browser
        .attribute(&scene.browser.find("input[name=csrf]"), "value")
        .expect("the page's token");
    submit(
        &scene,
        "/job/cancel",
        json!({ "id": id.to_string(), "csrf": token }),
    );
    scene
        .browser
        .wait_for_url("done=cancelled", |url| url.contains("done=cancelled"));
    assert_eq!(state(&mut scene.conn(), id), JobState::Cancelled);
}

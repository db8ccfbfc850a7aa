//! The dashboard's buttons in headless Chromium (SQLite), each changing the database: retry a
//! dead job, cancel a waiting one, pause and resume a queue, pause a schedule, force-release a
//! lease through its confirmation.

use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob};
use tenure::schedules::{self, Schedule};

use super::{Scene, TTL, dead, state};

#[test]
fn retry_on_a_dead_job_makes_it_wait() {
    let (scene, id) = Scene::new(|conn| {
        dead(
            conn,
            NewJob::new("mail", "digest", b"{}".to_vec()),
            "smtp down",
        )
    });
    scene.open(&format!("/job?id={id}"));
    let notice = scene.act("main", "/job/retry", "Retry", "retried-one");
    assert!(notice.starts_with("Retried"), "{notice}");
    assert_eq!(state(&mut scene.conn(), id), JobState::Waiting);
}

#[test]
fn cancel_on_a_waiting_job_cancels_it() {
    let (scene, id) = Scene::new(|conn| {
        jobs::enqueue(conn, &NewJob::new("mail", "welcome", vec![]))
            .unwrap()
            .id
    });
    scene.open(&format!("/job?id={id}"));
    let notice = scene.act("main", "/job/cancel", "Cancel", "cancelled");
    assert!(notice.starts_with("Cancelled"), "{notice}");
    assert_eq!(state(&mut scene.conn(), id), JobState::Cancelled);
}

#[test]
fn pause_then_resume_a_queue() {
    let (scene, ()) = Scene::new(|conn| {
        jobs::enqueue(conn, &NewJob::new("mail", "welcome", vec![])).unwrap();
    });
    // Reached from the overview, as a person would.
    scene.open("/");
    let link = scene.browser.find("#queues tr[data-queue=mail] a");
    scene.browser.click(&link);
    scene
        .browser
        .wait_for_url("the queue's page", |url| url.contains("/queue?name=mail"));
    assert_eq!(
        scene.browser.text(&scene.browser.find("#queue-state")),
        "active"
    );

    let notice = scene.act("main", "/queue/pause", "Pause", "queue-paused");
    assert!(notice.starts_with("Queue paused"), "{notice}");
    assert!(jobs::is_paused(&mut scene.conn(), "mail").unwrap());
    assert_eq!(
        scene.browser.text(&scene.browser.find("#queue-state")),
        "paused"
    );

    let notice = scene.act("main", "/queue/resume", "Resume", "queue-resumed");
    assert_eq!(notice, "Queue resumed.");
    assert!(!jobs::is_paused(&mut scene.conn(), "mail").unwrap());
    assert_eq!(
        scene.browser.text(&scene.browser.find("#queue-state")),
        "active"
    );
}

#[test]
fn pause_a_schedule() {
    let (scene, ()) = Scene::new(|conn| {
        for name in ["cleanup", "rollup"] {
            schedules::upsert(
                conn,
                &Schedule::every(
                    name,
                    Duration::from_secs(60),
                    NewJob::new("m", name, vec![]),
                ),
            )
            .unwrap();
        }
    });
    scene.open("/schedules");
    let notice = scene.act(
        "tr[data-schedule=cleanup]",
        "/schedule/pause",
        "Pause",
        "schedule-paused",
    );
    assert_eq!(notice, "Schedule paused.");
    let paused: Vec<(String, bool)> = schedules::list(&mut scene.conn())
        .unwrap()
        .into_iter()
        .map(|s| (s.name, s.paused))
        .collect();
    assert_eq!(
        paused,
        [("cleanup".to_string(), true), ("rollup".to_string(), false)]
    );
    // The row now offers Resume.
    scene
        .browser
        .find("tr[data-schedule=cleanup] form.action[action=\"/schedule/resume\"]");
}

#[test]
fn force_release_a_lease_through_its_confirmation() {
    let (scene, ()) = Scene::new(|conn| {
        tenure::lease::try_take(conn, "nightly-report", TTL, "host-a")
            .unwrap()
            .expect("free");
    });
    scene.open("/leases");
    let link = scene
        .browser
        .find("#leases tr[data-lease=nightly-report] a[href^=\"/lease/release\"]");
    assert_eq!(scene.browser.text(&link), "Force release…");
    scene.browser.click(&link);
    scene.browser.wait_for_url("the confirmation", |url| {
        url.contains("/lease/release?name=")
    });
    assert_eq!(
        scene.browser.text(&scene.browser.find("main h1")),
        "Force-release a lease"
    );
    // Seeing the confirmation changed nothing.
    let info = tenure::lease::inspect(&mut scene.conn(), "nightly-report")
        .unwrap()
        .unwrap();
    assert!(info.held);

    let notice = scene.act("main", "/lease/release", "Release it now", "released");
    assert_eq!(notice, "Lease released.");
    let info = tenure::lease::inspect(&mut scene.conn(), "nightly-report")
        .unwrap()
        .unwrap();
    assert!(!info.held, "{info:?}");
}

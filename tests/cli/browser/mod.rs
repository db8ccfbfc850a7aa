//! The dashboard in real headless Chromium (SQLite): every page renders (a screenshot of each
//! goes to artifacts/screenshots/); the buttons change the database (`actions.rs`), hostile
//! text stays text and a form without its CSRF token is refused (`hostile.rs`).
//!
//! Not here: `tenure serve --listen 0.0.0.0:0` without credentials refusing to start needs no
//! browser; the HTTP tests (tests/cli/serve/guards.rs) cover it.

mod actions;
mod hostile;

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use tenure::jobs::{self, JobState, NewJob, Retry};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count, poll_until, wait_until};
use crate::dashboard::{Served, serve};
use crate::webdriver::{Browser, DEADLINE};

const TTL: Duration = Duration::from_secs(600);

/// A database, a dashboard serving it, and a browser (dropped in this order).
struct Scene {
    browser: Browser,
    served: Served,
    db: TestDb,
}

impl Scene {
    /// A migrated SQLite database, filled by `seed` before the dashboard starts.
    fn new<T>(seed: impl FnOnce(&mut AnyConnection) -> T) -> (Scene, T) {
        let db = TestDb::migrated(Backend::Sqlite);
        let seeded = seed(&mut db.connect());
        let served = serve(db.url(), &[], &[]);
        let browser = Browser::start();
        (
            Scene {
                browser,
                served,
                db,
            },
            seeded,
        )
    }

    /// Loads `path` and gives its `h1`.
    fn open(&self, path: &str) -> String {
        self.browser
            .navigate(&format!("{}{path}", self.served.base));
        self.browser.text(&self.browser.find("main h1"))
    }

    /// Clicks the button of the action form posting to `action` inside `scope`, checks its
    /// label, and waits for the page the action leads to (its URL has `done=<done>`); gives
    /// that page's notice.
    fn act(&self, scope: &str, action: &str, label: &str, done: &str) -> String {
        let button = self.browser.find(&format!(
            "{scope} form.action[action=\"{action}\"] button[type=submit]"
        ));
        assert_eq!(self.browser.text(&button), label);
        self.browser.click(&button);
        let marker = format!("done={done}");
        self.browser
            .wait_for_url(&marker, |url| url.contains(&marker));
        self.browser.text(&self.browser.find("p.notice"))
    }

    fn conn(&self) -> AnyConnection {
        self.db.connect()
    }
}

/// Enqueues a job, claims it (it must be the one claimed) and gives the claim.
fn claimed(conn: &mut AnyConnection, job: NewJob) -> jobs::ClaimedJob {
    let id = jobs::enqueue(conn, &job).unwrap().id;
    let queue = job_queue(conn, id);
    // A retry due "now" may be a tick ahead of the database clock's next reading.
    let claim = wait_until(&format!("job {id} to become claimable"), DEADLINE, || {
        jobs::claim(conn, &queue, 1, TTL).unwrap().pop()
    });
    assert_eq!(claim.id, id, "claimed another job than the one enqueued");
    claim
}

fn job_queue(conn: &mut AnyConnection, id: i64) -> String {
    jobs::get(conn, id).unwrap().unwrap().queue
}

fn completed(conn: &mut AnyConnection, job: NewJob) -> i64 {
    let claim = claimed(conn, job);
    jobs::complete(conn, &[claim.claim()]).unwrap();
    claim.id
}

/// A job dead after one failed run with `error`.
fn dead(conn: &mut AnyConnection, job: NewJob, error: &str) -> i64 {
    let claim = claimed(conn, job);
    assert_eq!(
        jobs::fail(conn, claim.claim(), error, Retry::Never).unwrap(),
        jobs::Outcome::Done
    );
    claim.id
}

/// A job that failed `runs` times (retried at once in between) and is dead after the last.
fn failed_runs(conn: &mut AnyConnection, job: NewJob, errors: &[&str]) -> i64 {
    let mut claim = claimed(conn, job.max_attempts(errors.len() as u32));
    let id = claim.id;
    let queue = job_queue(conn, id);
    for (i, error) in errors.iter().enumerate() {
        jobs::fail(conn, claim.claim(), error, Retry::After(Duration::ZERO)).unwrap();
        if i + 1 == errors.len() {
            break;
        }
        claim = wait_until(&format!("job {id} to be retried"), DEADLINE, || {
            jobs::claim(conn, &queue, 1, TTL).unwrap().pop()
        });
        assert_eq!(claim.id, id);
    }
    assert_eq!(jobs::get(conn, id).unwrap().unwrap().state, JobState::Dead);
    id
}

fn state(conn: &mut AnyConnection, id: i64) -> JobState {
    jobs::get(conn, id).unwrap().unwrap().state
}

fn screenshot_path(page: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("artifacts/screenshots")
        .join(format!("{page}.png"))
}

struct Realistic {
    charge: i64,
}

/// Several queues with completed, dead, waiting and running jobs, a job with three failed
/// runs, a paused queue, two leases and two schedules.
fn realistic(conn: &mut AnyConnection) -> Realistic {
    for user in 1..=6 {
        completed(
            conn,
            NewJob::json("mail", "welcome", &json!({ "user": user })).unwrap(),
        );
    }
    dead(
        conn,
        NewJob::json("mail", "digest", &json!({ "user": 7 })).unwrap(),
        "smtp: 550 mailbox unavailable",
    );
    dead(
        conn,
        NewJob::json("mail", "digest", &json!({ "user": 8 })).unwrap(),
        "smtp: connection reset by peer",
    );
    let charge = failed_runs(
        conn,
        NewJob::json(
            "billing",
            "charge-card",
            &json!({ "invoice": "INV-2024-0042", "amount_cents": 12_900, "currency": "EUR",
                     "customer": { "id": 311, "email": "ada@example.com" } }),
        )
        .unwrap(),
        &[
            "payment gateway timed out after 30 s",
            "payment gateway: 502 Bad Gateway\nretry-after: 10",
            "card declined: insufficient funds (code 51)",
        ],
    );
    completed(
        conn,
        NewJob::json(
            "billing",
            "invoice-pdf",
            &json!({ "invoice": "INV-2024-0041" }),
        )
        .unwrap(),
    );
    // Running: claimed and never finished (the claim lasts the test).
    claimed(
        conn,
        NewJob::json("mail", "newsletter", &json!({ "issue": 12 })).unwrap(),
    );
    for n in 0..4 {
        jobs::enqueue(
            conn,
            &NewJob::json("mail", "welcome", &json!({ "user": 100 + n })).unwrap(),
        )
        .unwrap();
    }
    jobs::enqueue(
        conn,
        &NewJob::json(
            "billing",
            "invoice-pdf",
            &json!({ "invoice": "INV-2024-0043" }),
        )
        .unwrap()
        .delay(Duration::from_secs(3600)),
    )
    .unwrap();
    jobs::enqueue(
        conn,
        &NewJob::new("reports", "weekly-summary", b"week 23".to_vec()),
    )
    .unwrap();
    jobs::pause(conn, "reports").unwrap();
    tenure::lease::try_take(conn, "nightly-report", TTL, "host-a pid 4242")
        .unwrap()
        .expect("the lease is free");
    tenure::lease::try_take(conn, "schema-migrations", TTL, "deploy-7")
        .unwrap()
        .expect("the lease is free");
    schedules::upsert(
        conn,
        &Schedule::every(
            "cleanup",
            Duration::from_secs(15 * 60),
            NewJob::new("maintenance", "cleanup", vec![]),
        ),
    )
    .unwrap();
    schedules::upsert(
        conn,
        &Schedule::cron(
            "weekly-report",
            "0 6 * * 1",
            NewJob::new("reports", "weekly-summary", vec![]),
        )
        .time_zone("Europe/Paris"),
    )
    .unwrap();
    Realistic { charge }
}

#[test]
fn every_page_loads_and_is_screenshotted() {
    let (scene, seeded) = Scene::new(realistic);
    // A registered worker for the workers page (its queue has no jobs).
    let worker = tenure::worker::Worker::builder(scene.db.pool(4))
        .queue("thumbnails")
        .threads(1)
        .raw_handler("resize", |_: &tenure::worker::JobContext, _: &[u8]| Ok(()))
        .start()
        .unwrap();
    poll_until(DEADLINE, Duration::from_millis(20), || {
        (count(
            &mut scene.conn(),
            "SELECT COUNT(*) AS n FROM tenure_workers",
        ) > 0)
            .then_some(())
    })
    .expect("the worker never registered");
    let charge = seeded.charge.to_string();
    let job_title = format!("Job {charge}");
    let pages: [(&str, String, &str, &str); 8] = [
        (
            "queues",
            "/".into(),
            "Queues",
            "#queues tr[data-queue=billing]",
        ),
        (
            "queue",
            "/queue?name=mail".into(),
            "Queue mail",
            "svg#throughput",
        ),
        ("jobs", "/jobs".into(), "Jobs", "#jobs tr[data-id]"),
        ("job", format!("/job?id={charge}"), &job_title, "#errors"),
        (
            "leases",
            "/leases".into(),
            "Leases",
            "#leases tr[data-lease=nightly-report]",
        ),
        (
            "lease-release",
            "/lease/release?name=nightly-report".into(),
            "Force-release a lease",
            "form.action[action=\"/lease/release\"]",
        ),
        (
            "schedules",
            "/schedules".into(),
            "Schedules",
            "#schedules tr[data-schedule=cleanup]",
        ),
        ("workers", "/workers".into(), "Workers", "#workers tbody tr"),
    ];
    for (name, path, title, present) in &pages {
        assert_eq!(&scene.open(path), title, "{path}");
        scene.browser.find(present);
        scene.browser.screenshot(&screenshot_path(name));
    }
    // The contents that matter, as a reader sees them.
    scene.open(&format!("/job?id={charge}"));
    let fields = scene.browser.text(&scene.browser.find("#job-fields"));
    assert!(
        fields.contains("charge-card") && fields.contains("3 of 3"),
        "{fields}"
    );
    let payload = scene.browser.text(&scene.browser.find("#payload"));
    assert!(payload.contains("INV-2024-0042"), "{payload}");
    let errors = scene.browser.text(&scene.browser.find("#errors"));
    assert!(
        errors.contains("card declined") && errors.contains("502 Bad Gateway"),
        "{errors}"
    );
    scene.open("/");
    let paused = scene
        .browser
        .text(&scene.browser.find("#queues tr[data-queue=reports]"));
    assert!(paused.contains("paused"), "{paused}");
    worker.shutdown(Duration::from_secs(5));
}

//! Parked jobs from the command and `tenure serve`: `tenure jobs complete-parked`,
//! `fail-parked` and `resume-parked` read the token from stdin or a file and exit 8 for any
//! refused token; the callback endpoint answers by the token alone (no dashboard credentials),
//! the same 403 for every refused token, and never logs it; the job page's form answers a
//! parked job under the dashboard's CSRF guard.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob};

use super::common::{TestDb, conformance};
use super::dashboard::{Answer, csrf, get_with, post_with, serve};
use super::{json, tenure};

conformance!(
    the_command_answers_parked_jobs_with_a_token_from_stdin_or_a_file,
    the_callback_answers_by_the_token_alone_and_refuses_every_bad_token_alike,
    the_job_page_answers_a_parked_job_under_the_csrf_guard,
);

const HOUR: Duration = Duration::from_secs(3600);

/// `tenure ARGS` with `stdin` as its standard input.
fn tenure_stdin(url: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
        .args(["--database-url", url])
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tenure");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().expect("wait for tenure")
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn parked(conn: &mut tenure::AnyConnection) -> jobs::EnqueuedParked {
    jobs::enqueue_parked(conn, &NewJob::new("p", "k", b"0".to_vec()), HOUR).unwrap()
}

fn the_command_answers_parked_jobs_with_a_token_from_stdin_or_a_file(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let mut conn = db.connect();
    let (a, b, c) = (parked(&mut conn), parked(&mut conn), parked(&mut conn));
    // Listed and counted as parked.
    let listed = json(url, &["jobs", "list", "--state", "parked"]);
    assert_eq!(listed.as_array().unwrap().len(), 3);
    let stats = json(url, &["stats"]);
    assert_eq!(stats["queues"][0]["parked"], 3, "{stats}");
    // `jobs show` says when it parked, its deadline and that nobody answered yet.
    let shown = tenure(url, &["jobs", "show", &a.id.to_string()]);
    let text = said(&shown);
    assert!(shown.status.success(), "{text}");
    for line in ["parked: ", "park deadline: ", "park answer: none yet"] {
        assert!(text.contains(line), "{line:?} missing from:\n{text}");
    }

    // From stdin, with a result.
    let secret = a.token.expose_secret();
    let out = tenure_stdin(
        url,
        &[
            "--json",
            "jobs",
            "complete-parked",
            "--result",
            r#"{"paid":true}"#,
        ],
        &format!("{secret}\n"),
    );
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(
        jobs::get(&mut conn, a.id).unwrap().unwrap().state,
        JobState::Completed
    );
    let result = jobs::result(&mut conn, a.id).unwrap().unwrap();
    assert_eq!(result.decode::<serde_json::Value>().unwrap()["paid"], true);
    let shown = json(url, &["jobs", "show", &a.id.to_string()]);
    assert_eq!(shown["park"]["answer"], "complete", "{shown}");
    assert!(!shown.to_string().contains(&secret[4..20]), "{shown}");
    // Used again, garbage, or a wrong secret: exit 8, nothing changed, the token unsaid.
    let wrong = format!("{}.{}", b.id, "0".repeat(64));
    for bad in [secret.as_str(), "garbage", wrong.as_str()] {
        let out = tenure_stdin(url, &["jobs", "complete-parked"], bad);
        assert_eq!(out.status.code(), Some(8), "{}", said(&out));
        assert!(!said(&out).contains(&secret[4..20]), "{}", said(&out));
    }
    assert_eq!(
        jobs::get(&mut conn, b.id).unwrap().unwrap().state,
        JobState::Parked
    );

    // From a file: fail (a retry: it had used no attempt), and resume with a value.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), b.token.expose_secret()).unwrap();
    let path = file.path().to_str().unwrap();
    let out = tenure(
        url,
        &[
            "jobs",
            "fail-parked",
            "--token-file",
            path,
            "--error",
            "declined",
        ],
    );
    assert!(out.status.success(), "{}", said(&out));
    let job = jobs::get(&mut conn, b.id).unwrap().unwrap();
    assert_eq!(
        (job.state, job.last_error.as_deref()),
        (JobState::Waiting, Some("declined"))
    );
    std::fs::write(file.path(), c.token.expose_secret()).unwrap();
    let out = tenure(
        url,
        &[
            "jobs",
            "resume-parked",
            "--token-file",
            path,
            "--value",
            "42",
        ],
    );
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(
        jobs::get(&mut conn, c.id).unwrap().unwrap().state,
        JobState::Waiting
    );
    // Bad input before any token is read: exit 2.
    let out = tenure(
        url,
        &[
            "jobs",
            "resume-parked",
            "--token-file",
            path,
            "--value",
            "{",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", said(&out));
}

/// A callback: POST with the token header and a body.
fn callback(base: &str, what: &str, token: Option<&str>, body: &str) -> Answer {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();
    let mut request = agent.post(format!("{base}/callbacks/parked/{what}"));
    if let Some(token) = token {
        request = request.header("Tenure-Park-Token", token);
    }
    let response = request
        .header("Content-Type", "application/json")
        .send(body)
        .expect("POST");
    let status = response.status().as_u16();
    let body = response.into_body().read_to_string().unwrap();
    Answer {
        status,
        body,
        headers: Vec::new(),
    }
}

fn the_callback_answers_by_the_token_alone_and_refuses_every_bad_token_alike(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let (a, b) = (parked(&mut conn), parked(&mut conn));
    // The dashboard wants credentials; the callback does not ask for them.
    let credential = "a-dashboard-token-0123456789";
    let mut served = serve(db.url(), &[], &[("TENURE_SERVE_TOKEN", credential)]);
    let base = served.base.clone();
    assert_eq!(get_with(&base, "/", &[]).status, 401);

    let secret = a.token.expose_secret();
    let done = callback(&base, "complete", Some(&secret), r#"{"payment":"pay_1"}"#);
    assert_eq!(done.status, 200, "{}", done.body);
    let reply: serde_json::Value = serde_json::from_str(&done.body).unwrap();
    assert_eq!(
        (reply["job"].as_i64(), reply["applied"].as_bool()),
        (Some(a.id), Some(true))
    );
    assert_eq!(
        jobs::get(&mut conn, a.id).unwrap().unwrap().state,
        JobState::Completed
    );
    let stored = jobs::result(&mut conn, a.id).unwrap().unwrap();
    assert_eq!(
        stored.decode::<serde_json::Value>().unwrap()["payment"],
        "pay_1"
    );

    // Every bad token: the same answer, nothing changed.
    let wrong = format!("{}.{}", b.id, "a".repeat(64));
    let mut answers = Vec::new();
    for token in [Some(secret.as_str()), Some(wrong.as_str()), Some("x"), None] {
        for what in ["complete", "fail", "resume"] {
            let body = if what == "fail" { "declined" } else { "" };
            let answer = callback(&base, what, token, body);
            answers.push((answer.status, answer.body));
        }
    }
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
    assert_eq!(answers[0].0, 403);
    assert_eq!(
        jobs::get(&mut conn, b.id).unwrap().unwrap().state,
        JobState::Parked
    );
    // A body that is not JSON is refused before the token is looked at.
    let bad = callback(&base, "complete", Some(&b.token.expose_secret()), "{");
    assert_eq!(bad.status, 400);
    assert_eq!(
        jobs::get(&mut conn, b.id).unwrap().unwrap().state,
        JobState::Parked
    );
    // The right token for b: resumed.
    let resumed = callback(&base, "resume", Some(&b.token.expose_secret()), "\"ok\"");
    assert_eq!(resumed.status, 200, "{}", resumed.body);
    assert_eq!(
        jobs::get(&mut conn, b.id).unwrap().unwrap().state,
        JobState::Waiting
    );
    // No token in the log.
    served.terminate();
    let log = served.log();
    assert!(log.contains("/callbacks/parked/complete"), "{log}");
    for token in [&secret, &b.token.expose_secret()] {
        let hex = token.split_once('.').unwrap().1;
        assert!(!log.contains(&hex[..16]), "{log}");
    }

    // Read-only refuses callbacks.
    let c = parked(&mut conn);
    let served = serve(db.url(), &["--read-only"], &[]);
    let refused = callback(&served.base, "complete", Some(&c.token.expose_secret()), "");
    assert_eq!(refused.status, 403);
    assert_eq!(
        jobs::get(&mut conn, c.id).unwrap().unwrap().state,
        JobState::Parked
    );
}

fn the_job_page_answers_a_parked_job_under_the_csrf_guard(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = parked(&mut conn);
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let page = get_with(base, &format!("/job?id={}", a.id), &[]);
    assert_eq!(page.status, 200);
    assert!(page.body.contains("park-answer"), "{}", page.body);
    for field in ["Park deadline", "none yet"] {
        assert!(
            page.body.contains(field),
            "{field:?} missing: {}",
            page.body
        );
    }
    let csrf = csrf(&page.body);
    let id = a.id.to_string();
    let secret = a.token.expose_secret();
    let fields = |csrf: &str| -> Vec<(&str, String)> {
        vec![
            ("csrf", csrf.to_string()),
            ("id", id.clone()),
            ("token", secret.clone()),
            ("answer", "complete".to_string()),
            ("value", "7".to_string()),
        ]
    };
    let post = |fields: &[(&str, String)]| {
        let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
        post_with(base, "/job/parked", &fields, &[])
    };
    // Without the CSRF token: refused, nothing changed.
    assert_eq!(post(&fields("stale")).status, 403);
    assert_eq!(
        jobs::get(&mut conn, a.id).unwrap().unwrap().state,
        JobState::Parked
    );
    // A wrong token: back to the page saying so, nothing changed.
    let mut wrong = fields(&csrf);
    wrong[2].1 = format!("{}.{}", a.id, "0".repeat(64));
    let answer = post(&wrong);
    assert_eq!(answer.status, 303);
    assert!(answer.header("Location").unwrap().contains("park-refused"));
    assert_eq!(
        jobs::get(&mut conn, a.id).unwrap().unwrap().state,
        JobState::Parked
    );
    // The right one: completed with its result.
    let answer = post(&fields(&csrf));
    assert_eq!(answer.status, 303);
    assert!(answer.header("Location").unwrap().contains("park-applied"));
    assert_eq!(
        jobs::get(&mut conn, a.id).unwrap().unwrap().state,
        JobState::Completed
    );
    assert_eq!(
        jobs::result(&mut conn, a.id)
            .unwrap()
            .unwrap()
            .decode::<i32>()
            .unwrap(),
        7
    );
}

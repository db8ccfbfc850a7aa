//! What guards the dashboard: actions need the CSRF token and this origin, read-only offers
//! and accepts no action, and listening beyond loopback needs credentials, asked of every
//! request.

use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob};
use tenure::{Backend, lease};

use super::{dead_job, location, state};
use crate::common::{TestDb, conformance};
use crate::dashboard::{csrf, get, get_with, post, post_with, serve};

conformance!(
    actions_need_the_csrf_token_and_this_origin,
    read_only_offers_and_accepts_no_action,
);

fn actions_need_the_csrf_token_and_this_origin(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let token = csrf(&get(base, &format!("/job?id={id}")).body);
    let id_text = id.to_string();
    type Fields<'a> = Vec<(&'a str, &'a str)>;
    let refusals: Vec<(&str, Fields, Fields)> = vec![
        ("no token", vec![("id", &id_text)], vec![]),
        (
            "a wrong token",
            vec![("id", &id_text), ("csrf", "0123")],
            vec![],
        ),
        (
            "another origin",
            vec![("id", &id_text), ("csrf", &token)],
            vec![("Origin", "http://evil.example")],
        ),
        (
            "an opaque origin (a sandboxed frame, a data: page)",
            vec![("id", &id_text), ("csrf", &token)],
            vec![("Origin", "null")],
        ),
        (
            "another site",
            vec![("id", &id_text), ("csrf", &token)],
            vec![("Sec-Fetch-Site", "cross-site")],
        ),
    ];
    for (what, fields, headers) in refusals {
        let answer = post_with(base, "/job/cancel", &fields, &headers);
        assert_eq!(answer.status, 403, "{what}: {}", answer.body);
        assert_eq!(state(&mut conn, id), JobState::Waiting, "{what}");
    }
    // An action is never a GET.
    assert_eq!(
        get(base, &format!("/job/cancel?id={id}&csrf={token}")).status,
        404
    );
    assert_eq!(state(&mut conn, id), JobState::Waiting);
    // The same origin, with the token: done.
    let own = served.base.trim_start_matches("http://").to_string();
    let answer = post_with(
        base,
        "/job/cancel",
        &[("id", &id_text), ("csrf", &token)],
        &[
            ("Origin", &format!("http://{own}")),
            ("Sec-Fetch-Site", "same-origin"),
        ],
    );
    location(&answer);
    assert_eq!(state(&mut conn, id), JobState::Cancelled);
    // A page asked for under a name that is not loopback (DNS rebinding) is refused.
    assert_eq!(get_with(base, "/", &[("Host", "evil.example")]).status, 421);
}

fn read_only_offers_and_accepts_no_action(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let dead = dead_job(&mut conn, "q", "k", b"{}", "boom");
    lease::try_take(&mut conn, "l", Duration::from_secs(60), "me")
        .unwrap()
        .unwrap();
    let served = serve(db.url(), &["--read-only"], &[]);
    for path in [
        "/".to_string(),
        format!("/job?id={dead}"),
        "/queue?name=q".into(),
        "/leases".into(),
    ] {
        let page = get(&served.base, &path);
        assert_eq!(page.status, 200);
        assert!(
            !page.body.contains("method=\"post\""),
            "{path} offers an action"
        );
        assert!(!page.body.contains("Force release"), "{path}");
    }
    let answer = post(
        &served.base,
        "/job/retry",
        &[("id", &dead.to_string()), ("csrf", "x")],
    );
    assert_eq!(answer.status, 403);
    assert_eq!(state(&mut conn, dead), JobState::Dead);
}

/// Listening beyond loopback needs credentials, which are then asked of every request; the
/// database URL and the secret appear in no page and no log line.
#[test]
fn credentials_guard_a_dashboard_beyond_loopback() {
    let db = TestDb::migrated(Backend::Sqlite);
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_tenure"));
        command
            .args(["--database-url", db.url(), "serve"])
            .args(args)
            .env_remove("TENURE_SERVE_TOKEN")
            .env_remove("TENURE_SERVE_BASIC_AUTH");
        for (name, value) in env {
            command.env(name, value);
        }
        command.output().expect("run tenure serve")
    };
    let refused = run(&["--listen", "0.0.0.0:0"], &[]);
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("TENURE_SERVE_TOKEN") && said.contains("TENURE_SERVE_BASIC_AUTH"),
        "{said}"
    );
    let weak = run(
        &["--listen", "0.0.0.0:0"],
        &[("TENURE_SERVE_TOKEN", "short")],
    );
    assert_eq!(weak.status.code(), Some(2));
    let both = run(
        &["--listen", "0.0.0.0:0"],
        &[
            ("TENURE_SERVE_TOKEN", "a-long-enough-token"),
            ("TENURE_SERVE_BASIC_AUTH", "u:a-long-enough-pass"),
        ],
    );
    assert_eq!(both.status.code(), Some(2));

    let secret = "s3cret-token-0123456789";
    let served = serve(db.url(), &[], &[("TENURE_SERVE_TOKEN", secret)]);
    let base = &served.base;
    let bare = get(base, "/");
    assert_eq!(bare.status, 401);
    assert!(
        bare.header("WWW-Authenticate")
            .is_some_and(|h| h.starts_with("Basic"))
    );
    assert_eq!(
        get_with(
            base,
            "/",
            &[("Authorization", "Bearer wrong-token-0123456789")]
        )
        .status,
        401
    );
    let bearer = get_with(base, "/", &[("Authorization", &format!("Bearer {secret}"))]);
    assert_eq!(bearer.status, 200);
    use base64::Engine;
    let basic = |pair: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    };
    assert_eq!(
        get_with(
            base,
            "/",
            &[("Authorization", &basic(&format!("anyone:{secret}")))]
        )
        .status,
        200
    );
    // Guarded, any Host name is answered (it is served beyond loopback).
    assert_eq!(
        get_with(
            base,
            "/",
            &[
                ("Authorization", &format!("Bearer {secret}")),
                ("Host", "tenure.example")
            ]
        )
        .status,
        200
    );
    assert!(!bearer.body.contains(secret) && !bearer.body.contains(db.url()));
    let log = served.log();
    assert!(log.contains("GET / 200"), "{log}");
    assert!(!log.contains(secret) && !log.contains(db.url()), "{log}");
    drop(served);

    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "ops:a-long-enough-password\n").unwrap();
    let path = file.path().to_str().unwrap();
    let served = serve(db.url(), &["--basic-auth-file", path], &[]);
    assert_eq!(
        get_with(
            &served.base,
            "/",
            &[("Authorization", &basic("ops:a-long-enough-password"))]
        )
        .status,
        200
    );
    assert_eq!(
        get_with(
            &served.base,
            "/",
            &[("Authorization", &basic("ops:wrong-password-but-long"))]
        )
        .status,
        401
    );
    assert_eq!(
        get_with(
            &served.base,
            "/",
            &[("Authorization", &basic("dev:a-long-enough-password"))]
        )
        .status,
        401
    );
}

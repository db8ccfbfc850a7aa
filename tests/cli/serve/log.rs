//! What `tenure serve` writes to its log: nothing forged through the path, no queries, forms or
//! credentials.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use base64::Engine;
use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::TestDb;
use crate::dashboard::{csrf, get_with, post_with, serve};

/// How long a test waits for any one answer: far longer than a loaded machine needs.
const PATIENCE: Duration = Duration::from_secs(30);

fn addr(base: &str) -> &str {
    base.trim_start_matches("http://")
}

fn connect(base: &str) -> TcpStream {
    let stream = TcpStream::connect(addr(base)).expect("connect to tenure serve");
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream.set_write_timeout(Some(PATIENCE)).unwrap();
    stream
}

/// Sends `request` as is, closes the writing half (so a server that waits for more reads an
/// end instead) and returns everything the server sent until it closed. A server that neither
/// answers nor closes within `PATIENCE` fails the test.
fn raw(base: &str, request: &[u8]) -> String {
    let mut stream = connect(base);
    // A server may close before reading everything (and then the write fails): its answer
    // is still there to read.
    let _ = stream.write_all(request);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    match stream.read_to_end(&mut out) {
        Ok(_) => {}
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {}
        Err(e) => panic!(
            "no whole answer to {:?} within {PATIENCE:?}: {e}; got {:?}",
            String::from_utf8_lossy(&request[..request.len().min(300)]),
            String::from_utf8_lossy(&out)
        ),
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status of a raw answer (0 when the server closed without one).
fn status(answer: &str) -> u16 {
    answer
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

fn basic(pair: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

/// The request path must not forge log lines: a line feed in it (the old server ended a
/// line only at CRLF) wrote a line of the attacker's choosing into the log.
#[test]
fn the_log_cannot_be_forged_through_the_path() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = serve(db.url(), &[], &[]);
    let answer = raw(
        &served.base,
        b"GET /nowhere\nFORGED\ttenure::serve:\tPOST\t/lease/release\t303\x1b[2J HTTP/1.1\r\n\
          Host: localhost\r\nConnection: close\r\n\r\n",
    );
    // Refused (a line feed alone does not end a line) or not found; never a forged line.
    assert!(matches!(status(&answer), 400 | 404), "{answer}");
    let log = served.log();
    assert!(
        !log.lines().any(|line| line.starts_with("FORGED")),
        "a forged log line:\n{log}"
    );
    assert!(
        !log.contains('\u{1b}'),
        "an escape character reached the log: {log:?}"
    );
}

/// The log holds one line per request, without the query, the form, the CSRF token or the
/// credentials; a 500's line names no URL.
#[test]
fn the_log_keeps_queries_forms_and_credentials_out() {
    let db = TestDb::migrated(Backend::Sqlite);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let secret = "log-me-not-0123456789";
    let served = serve(db.url(), &[], &[("TENURE_SERVE_TOKEN", secret)]);
    let auth = format!("Bearer {secret}");
    let page = get_with(
        &served.base,
        &format!("/job?id={id}&text=query-secret"),
        &[("Authorization", &auth)],
    );
    let token = csrf(&page.body);
    post_with(
        &served.base,
        "/job/cancel",
        &[
            ("csrf", &token),
            ("id", &id.to_string()),
            ("note", "form-secret"),
        ],
        &[("Authorization", &auth)],
    );
    get_with(
        &served.base,
        "/",
        &[("Authorization", &basic(&format!("user-secret:{secret}")))],
    );
    get_with(
        &served.base,
        "/",
        &[("Authorization", "Bearer wrong-secret-0123456789")],
    );
    let log = served.log();
    for hidden in [
        secret,
        "query-secret",
        "form-secret",
        token.as_str(),
        "user-secret",
        "wrong-secret",
        db.url(),
    ] {
        assert!(!log.contains(hidden), "the log holds {hidden:?}:\n{log}");
    }
    assert!(log.contains("POST /job/cancel 303"), "{log}");
    assert!(log.contains("GET / 401"), "{log}");
}

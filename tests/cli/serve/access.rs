//! Who may ask `tenure serve` for what: Host headers (loopback look-alikes, odd spellings),
//! Authorization edge cases, path, method and id tricks, CSRF and origin subtleties, and a
//! force-release's confirmation (refused read-only).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use base64::Engine;
use tenure::jobs::{self, JobState, NewJob};
use tenure::{AnyConnection, Backend, lease};

use crate::common::TestDb;
use crate::dashboard::{csrf, get, get_with, post, post_with, serve};
use crate::serve::state;

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

fn held(conn: &mut AnyConnection, name: &str) -> bool {
    lease::inspect(conn, name)
        .unwrap()
        .is_some_and(|info| info.held)
}

/// A Host that starts with a loopback name and goes on after `]` or `:` with anything
/// (`[::1].evil.example`, `localhost:80@evil.example`, `localhost:evil.example`) is taken
/// for loopback: the check reads up to `]`, or cuts at the last `:`, and never looks at the
/// rest (the port is not checked to be digits). No browser sends such a Host (its URL parser
/// refuses or re-reads it: `http://localhost:80@evil.example/` is host `evil.example`), so
/// DNS rebinding cannot use it; but it is not a loopback name, and the rule says only those
/// are answered.
#[test]
fn a_host_that_only_starts_like_a_loopback_address_is_refused() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = serve(db.url(), &[], &[]);
    let port = addr(&served.base).rsplit(':').next().unwrap().to_string();
    for host in [
        "[::1].evil.example".to_string(),
        "[::1]evil.example:80".into(),
        "[::1]@evil.example".into(),
        format!("localhost:{port}@evil.example"),
        "localhost:evil.example".into(),
        "127.0.0.1:80.evil.example".into(),
    ] {
        let answer = raw(
            &served.base,
            format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        );
        assert_eq!(status(&answer), 421, "Host {host}: {answer}");
    }
}

// ---------------------------------------------------------------------------------------
// Attacks the server withstands (these pass).
// ---------------------------------------------------------------------------------------

/// Unguarded, only loopback names are answered, however the Host header is dressed up.
#[test]
fn odd_host_headers_are_refused_unguarded() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let port = addr(base).rsplit(':').next().unwrap();
    for host in [
        "localhost.evil.example".to_string(),
        format!("localhost.evil.example:{port}"),
        "127.0.0.1.nip.io".into(),
        "evil.example".into(),
        format!("evil.example:{port}"),
        "user@localhost".into(),
        "localhost:80:81".into(),
        "localhost.".into(),
        "::1".into(),
        "[::ffff:127.0.0.1]".into(),
        "0.0.0.0".into(),
        "127.1".into(),
        "2130706433".into(),
        "".into(),
    ] {
        let answer = raw(
            base,
            format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        );
        assert_eq!(status(&answer), 421, "Host {host:?}: {answer}");
    }
    // No Host at all (HTTP/1.0), and an absolute-form target naming another host.
    assert_eq!(status(&raw(base, b"GET / HTTP/1.0\r\n\r\n")), 421);
    let absolute = raw(
        base,
        b"GET http://evil.example/ HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&absolute), 421, "{absolute}");
    // The loopback forms are answered; an absolute-form target is no page.
    for host in [
        format!("localhost:{port}"),
        "LocalHost".into(),
        format!("127.0.0.1:{port}"),
        "127.9.9.9".into(),
        format!("[::1]:{port}"),
        "[::1]".into(),
    ] {
        let answer = raw(
            base,
            format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        );
        assert_eq!(status(&answer), 200, "Host {host:?}: {answer}");
    }
    let absolute = raw(
        base,
        b"GET http://evil.example/ HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&absolute), 404, "{absolute}");
    // Every refusal still carries the security headers.
    let refused = get_with(base, "/", &[("Host", "evil.example")]);
    assert_eq!(refused.header("X-Frame-Options"), Some("DENY"));
    assert_eq!(refused.header("X-Content-Type-Options"), Some("nosniff"));
}

/// Paths that look like an action, methods other than GET and POST, and ids in odd spellings
/// change nothing.
#[test]
fn path_method_and_id_tricks_change_nothing() {
    let db = TestDb::migrated(Backend::Sqlite);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let token = csrf(&get(base, &format!("/job?id={id}")).body);
    let form = format!("csrf={token}&id={id}");
    let send = |method: &str, path: &str| {
        raw(
            base,
            format!(
                "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
                 Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
                form.len()
            )
            .as_bytes(),
        )
    };
    for path in [
        "//job/cancel",
        "/job/../job/cancel",
        "/job/./cancel",
        "/job%2Fcancel",
        "/job/cancel/",
        "/JOB/CANCEL",
        "/%6Aob/cancel",
        "http://localhost/job/cancel",
    ] {
        let answer = send("POST", path);
        assert_eq!(status(&answer), 404, "POST {path}: {answer}");
    }
    for method in ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CANCEL"] {
        let answer = send(method, "/job/cancel");
        assert_eq!(status(&answer), 405, "{method}: {answer}");
    }
    // HEAD and GET never act.
    assert_eq!(status(&send("HEAD", "/job/cancel")), 404);
    let head = send("HEAD", "/");
    assert_eq!(status(&head), 200, "{head}");
    assert!(
        head.ends_with("\r\n\r\n"),
        "a HEAD reply has no body: {head}"
    );
    assert_eq!(get(base, &format!("/job/cancel?{form}")).status, 404);
    assert_eq!(state(&mut conn, id), JobState::Waiting);

    // Ids: a sign, spaces, zero, overflow, exponent, hex.
    assert_eq!(get(base, &format!("/job?id=%2B{id}")).status, 200);
    assert_eq!(get(base, &format!("/job?id=%20{id}%20")).status, 200);
    for bad in [
        "0",
        "-0",
        "-1",
        "9223372036854775808",
        "1e3",
        "0x1",
        "%00",
        "1%00",
        "%EF%BC%91",
    ] {
        let answer = get(base, &format!("/job?id={bad}"));
        assert_eq!(answer.status, 400, "id={bad}: {}", answer.body);
        assert!(answer.body.contains("is not a job id"), "id={bad}");
        let answer = post(base, "/job/cancel", &[("csrf", &token), ("id", bad)]);
        assert_eq!(answer.status, 400, "POST id={bad}: {}", answer.body);
    }
    // The largest id is a fine id with no job.
    assert_eq!(get(base, "/job?id=9223372036854775807").status, 404);
    assert_eq!(state(&mut conn, id), JobState::Waiting);
    // A trailing `?`, a fragment, a repeated `?`.
    assert_eq!(get(base, "/jobs?").status, 200);
    assert_eq!(
        status(&raw(
            base,
            b"GET /jobs?? HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )),
        200
    );
    assert_eq!(get(base, &format!("/job?id={id}%23x")).status, 400);
}

/// The CSRF check has no seams: a token given twice, in the query, in another body type,
/// from the null origin, another port or a shouting cross-site.
#[test]
fn csrf_and_origin_subtleties_are_refused() {
    let db = TestDb::migrated(Backend::Sqlite);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let own = addr(base).to_string();
    let port: u16 = own.rsplit(':').next().unwrap().parse().unwrap();
    let token = csrf(&get(base, &format!("/job?id={id}")).body);
    let id_text = id.to_string();
    let wrong = "0".repeat(token.len());
    let spaced = format!("{token} ");
    type Refusal<'a> = (&'a str, Vec<(&'a str, &'a str)>, Vec<(String, String)>);
    let refused: Vec<Refusal> = vec![
        (
            "a wrong token first",
            vec![("csrf", &wrong), ("csrf", &token), ("id", &id_text)],
            vec![],
        ),
        (
            "a token one byte short",
            vec![("csrf", &token[1..]), ("id", &id_text)],
            vec![],
        ),
        (
            "a token with a space",
            vec![("csrf", &spaced), ("id", &id_text)],
            vec![],
        ),
        (
            "the null origin",
            vec![("csrf", &token), ("id", &id_text)],
            vec![("Origin".into(), "null".into())],
        ),
        (
            "another port",
            vec![("csrf", &token), ("id", &id_text)],
            vec![(
                "Origin".into(),
                format!("http://127.0.0.1:{}", port.wrapping_add(1)),
            )],
        ),
        (
            "the origin's name with a suffix",
            vec![("csrf", &token), ("id", &id_text)],
            vec![("Origin".into(), format!("http://{own}.evil.example"))],
        ),
        (
            "a file origin",
            vec![("csrf", &token), ("id", &id_text)],
            vec![("Origin".into(), format!("file://{own}"))],
        ),
        (
            "cross-site in capitals",
            vec![("csrf", &token), ("id", &id_text)],
            vec![("Sec-Fetch-Site".into(), "CROSS-SITE".into())],
        ),
    ];
    for (what, fields, headers) in refused {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let answer = post_with(base, "/job/cancel", &fields, &headers);
        assert_eq!(answer.status, 403, "{what}: {}", answer.body);
        assert_eq!(state(&mut conn, id), JobState::Waiting, "{what}");
    }
    // The token in the query string of a POST whose form lacks it.
    let send = |path: &str, content_type: &str, body: &str| {
        raw(
            base,
            format!(
                "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
                 Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
    };
    let form = format!("csrf={token}&id={id}");
    let answer = send(
        &format!("/job/cancel?{form}"),
        "application/x-www-form-urlencoded",
        "x=1",
    );
    assert_eq!(status(&answer), 403, "{answer}");
    // Bodies that are not forms, though they hold the right fields (what a cross-site
    // `fetch` without a preflight can send).
    for content_type in [
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/json",
        "application/x-www-form-urlencodedx",
    ] {
        let answer = send("/job/cancel", content_type, &form);
        assert_eq!(status(&answer), 415, "{content_type}: {answer}");
    }
    assert_eq!(state(&mut conn, id), JobState::Waiting);
    // A charset parameter, an empty first token and an empty id do no harm: the right
    // token and id, and the job is cancelled once.
    let answer = send(
        "/job/cancel",
        "Application/X-WWW-Form-Urlencoded; charset=ISO-8859-1",
        &format!("csrf=&{form}&id="),
    );
    assert_eq!(status(&answer), 303, "{answer}");
    assert_eq!(state(&mut conn, id), JobState::Cancelled);
}

/// A force-release needs exactly `confirm=yes`; read-only refuses it even with everything
/// right, and offers no form on its confirmation page.
#[test]
fn a_force_release_needs_its_confirmation_and_read_only_refuses_it() {
    let db = TestDb::migrated(Backend::Sqlite);
    let mut conn = db.connect();
    lease::try_take(&mut conn, "job-lock", Duration::from_secs(600), "host-a")
        .unwrap()
        .unwrap();
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let page = get(base, "/lease/release?name=job-lock&confirm=yes");
    assert_eq!(page.status, 200);
    assert!(held(&mut conn, "job-lock"), "a GET released the lease");
    let token = csrf(&page.body);
    for confirm in [
        vec![],
        vec!["YES"],
        vec!["yes "],
        vec!["yes-please"],
        vec!["1"],
        vec!["no", "yes"],
        vec!["", "no"],
    ] {
        let mut fields = vec![("csrf", token.as_str()), ("name", "job-lock")];
        fields.extend(confirm.iter().map(|c| ("confirm", *c)));
        let answer = post(base, "/lease/release", &fields);
        assert_eq!(answer.status, 400, "confirm {confirm:?}: {}", answer.body);
        assert!(answer.body.contains("confirm"), "{}", answer.body);
        assert!(held(&mut conn, "job-lock"), "confirm {confirm:?}");
    }
    drop(served);

    let served = serve(db.url(), &["--read-only"], &[]);
    let page = get(&served.base, "/lease/release?name=job-lock");
    assert_eq!(page.status, 200);
    assert!(
        !page.body.contains("<form class=\"action\""),
        "{}",
        page.body
    );
    assert!(!page.body.contains("name=\"csrf\""), "{}", page.body);
    // The other process's token is refused too.
    for path in [
        "/lease/release",
        "/queue/pause",
        "/job/retry",
        "/schedule/pause",
    ] {
        let answer = post(
            &served.base,
            path,
            &[
                ("csrf", &token),
                ("name", "job-lock"),
                ("confirm", "yes"),
                ("id", "1"),
            ],
        );
        assert_eq!(answer.status, 403, "{path}");
    }
    assert!(held(&mut conn, "job-lock"));
    assert!(!jobs::is_paused(&mut conn, "job-lock").unwrap());
}

/// Credentials: every odd spelling of the Authorization header is refused, the right ones
/// in any case of the scheme are let in, and actions still need the CSRF token.
#[test]
fn authorization_edge_cases() {
    let db = TestDb::migrated(Backend::Sqlite);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let token = "tok:en-0123456789abcdef";
    let served = serve(db.url(), &[], &[("TENURE_SERVE_TOKEN", token)]);
    let base = &served.base;
    let status_with = |headers: &[&str]| {
        let mut request = "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".to_string();
        for header in headers {
            request.push_str(header);
            request.push_str("\r\n");
        }
        request.push_str("\r\n");
        status(&raw(base, request.as_bytes()))
    };
    for header in [
        "Authorization: Bearer".to_string(),
        "Authorization: Bearer ".into(),
        format!("Authorization: Bearer{token}"),
        format!("Authorization: Bearer {}", &token[..token.len() - 1]),
        format!("Authorization: Bearer {token}x"),
        format!("Authorization: Token {token}"),
        format!("Authorization: {token}"),
        "Authorization: Basic".into(),
        format!("Authorization: Basic{}", &basic(&format!("u:{token}"))[6..]),
        "Authorization: Basic !!!not-base64!!!".into(),
        format!("Authorization: {}", basic(token)),
        format!("Authorization: {}", basic(&format!("{token}:"))),
        format!("Authorization: {}", basic(&format!("{token}:x"))),
        format!("Authorization: {}", basic(&format!("u:{token}\n"))),
        format!(
            "Authorization: Basic {}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("u:{token}?>"))
        ),
        format!("X-Authorization: Bearer {token}"),
        // The wrong one first: the first header counts.
        "Authorization: Bearer wrong".into(),
    ] {
        let mut headers = vec![header.as_str()];
        let second = format!("Authorization: Bearer {token}");
        if header == "Authorization: Bearer wrong" {
            headers.push(&second);
        }
        assert_eq!(status_with(&headers), 401, "{headers:?}");
    }
    for header in [
        format!("Authorization: bearer {token}"),
        format!("Authorization: BEARER   {token}  "),
        format!("Authorization: {}", basic(&format!(":{token}"))),
        format!(
            "Authorization: basic {}",
            &basic(&format!("anyone:{token}"))[6..]
        ),
    ] {
        assert_eq!(status_with(&[&header]), 200, "{header}");
    }
    // With credentials, actions still need the token; the 401 says nothing of the secret.
    let auth = format!("Bearer {token}");
    let answer = post_with(
        base,
        "/job/cancel",
        &[("id", &id.to_string())],
        &[("Authorization", &auth)],
    );
    assert_eq!(answer.status, 403);
    let answer = post(base, "/job/cancel", &[("id", &id.to_string())]);
    assert_eq!(answer.status, 401);
    assert!(!answer.body.contains(token));
    assert_eq!(state(&mut conn, id), JobState::Waiting);
    drop(served);

    // Basic auth: a password holding `:` works; an empty or other user does not.
    let served = serve(
        db.url(),
        &[],
        &[("TENURE_SERVE_BASIC_AUTH", "ops:pass:word-0123456789")],
    );
    let base = &served.base;
    let with = |value: &str| get_with(base, "/", &[("Authorization", value)]).status;
    assert_eq!(with(&basic("ops:pass:word-0123456789")), 200);
    assert_eq!(with(&basic("OPS:pass:word-0123456789")), 401);
    assert_eq!(with(&basic(":pass:word-0123456789")), 401);
    assert_eq!(with(&basic("ops:pass")), 401);
    assert_eq!(with(&basic("ops:pass:word-0123456789:")), 401);
    assert_eq!(with("Bearer pass:word-0123456789"), 401);
    assert_eq!(with("Bearer ops:pass:word-0123456789"), 401);
    let log = served.log();
    assert!(!log.contains("pass:word") && !log.contains(token), "{log}");
}

//! Attacks on `tenure serve`: raw HTTP a browser would never send, odd Host and Authorization
//! headers, path and method tricks, CSRF subtleties, hostile stored values, NUL bytes, a
//! database that goes away, slow and lying clients, and what reaches the log.
//!
//! Every request here is bounded by a socket timeout of tens of seconds, so a server that
//! stops answering fails a test instead of hanging it.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobResult, JobState, NewJob};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, lease};

use crate::common::{TestDb, conformance};
use crate::dashboard::{Answer, csrf, get, get_with, post, post_with, serve};

conformance!(
    nul_in_a_jobs_filter_is_bad_input,
    nul_and_oversized_names_are_bad_input_everywhere_else,
    stored_markup_is_escaped_on_every_page,
    a_database_error_is_a_500_and_the_server_serves_on,
);

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

/// Reads a reply's status line and headers (not its body) from a connection left open.
fn read_head(stream: &mut TcpStream) -> std::io::Result<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte)? == 0 {
            break;
        }
        head.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

/// `GET path` on its own connection, with `headers` (each a whole `Name: value` line),
/// answered within `PATIENCE` or an error.
fn timed_get(base: &str, path: &str, headers: &[&str]) -> std::io::Result<String> {
    let mut stream = connect(base);
    let mut request = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    for header in headers {
        request.push_str(header);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    let mut out = Vec::new();
    stream.read_to_end(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn encode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

fn basic(pair: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

use crate::serve::{dead_job, state};

fn held(conn: &mut AnyConnection, name: &str) -> bool {
    lease::inspect(conn, name)
        .unwrap()
        .is_some_and(|info| info.held)
}

/// A `tenure serve` whose process id is known (to read its memory); killed when dropped.
struct Watched {
    child: Child,
    base: String,
    log: tempfile::NamedTempFile,
}

impl Watched {
    fn start(url: &str, args: &[&str]) -> Watched {
        Watched::spawn(Command::new(env!("CARGO_BIN_EXE_tenure")), url, args)
    }

    /// Started with at most `files` open file descriptors.
    fn start_limited(url: &str, args: &[&str], files: u32) -> Watched {
        let mut command = Command::new("sh");
        command.args([
            "-c",
            &format!("ulimit -n {files} && exec \"$0\" \"$@\""),
            env!("CARGO_BIN_EXE_tenure"),
        ]);
        Watched::spawn(command, url, args)
    }

    fn spawn(mut command: Command, url: &str, args: &[&str]) -> Watched {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = command
            .args(["--database-url", url, "serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("TENURE_DATABASE_URL")
            .env_remove("DATABASE_URL")
            .env_remove("TENURE_SERVE_TOKEN")
            .env_remove("TENURE_SERVE_BASIC_AUTH")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("run tenure serve");
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        let base = first
            .split_whitespace()
            .find(|word| word.starts_with("http://"))
            .unwrap_or_else(|| panic!("tenure serve did not start: {first}"))
            .trim_end_matches('/')
            .to_string();
        Watched { child, base, log }
    }

    /// A figure of `/proc/PID/status`, in kB.
    fn memory(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in {status}"))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// Promises first broken by the HTTP server tenure used before its own (tiny_http 0.12): each
// of these failed with it.
// ---------------------------------------------------------------------------------------

/// A request that declares an enormous body must not kill the thread that answers it (the
/// old server drained an unread body into a buffer the size of what was left: past
/// `isize::MAX` a panic, around a terabyte an abort). Any client can
/// send it, before any credential is checked. With one handler thread, one request is enough
/// to stop the dashboard.
#[test]
fn a_huge_declared_body_neither_panics_nor_stops_the_server() {
    let db = TestDb::migrated(Backend::Sqlite);
    for length in ["9223372036854775808", "1099511627776"] {
        let served = Watched::start(db.url(), &["--threads", "1"]);
        let mut stream = connect(&served.base);
        stream
            .write_all(
                format!("GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: {length}\r\n\r\n")
                    .as_bytes(),
            )
            .unwrap();
        // Whatever it answers (it may refuse): the answer comes, then the body is dropped.
        let _ = read_head(&mut stream);
        let after = timed_get(&served.base, "/", &["Host: localhost"]);
        let log = served.log();
        assert!(
            after.as_ref().is_ok_and(|answer| status(answer) == 200),
            "Content-Length {length}: the next page got {after:?}; the log:\n{log}"
        );
        assert!(
            !log.contains("panicked") && !log.contains("memory allocation"),
            "Content-Length {length}: {log}"
        );
        drop(stream);
    }
}

/// Clients that declare a body and never send it, or send too large a body, must not hold
/// the threads every page needs: a body over the limit is refused before it is read, and
/// a body that does not come holds only a reader thread, until its deadline. On a guarded
/// server they need no credentials to try.
#[test]
fn clients_that_never_send_their_body_do_not_stall_the_dashboard() {
    let db = TestDb::migrated(Backend::Sqlite);
    let token = "a-long-enough-token-0123";
    let served = serve(db.url(), &[], &[("TENURE_SERVE_TOKEN", token)]);
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut stream = connect(&served.base);
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: anywhere\r\nContent-Length: 100000\r\n\r\n")
            .unwrap();
        let head = read_head(&mut stream).expect("the refusal");
        assert!(matches!(status(&head), 401 | 413), "{head}");
        stalled.push(stream);
    }
    for _ in 0..8 {
        let mut stream = connect(&served.base);
        stream
            .write_all(
                b"POST /job/cancel HTTP/1.1\r\nHost: anywhere\r\nContent-Length: 1000\r\n\r\nid=",
            )
            .unwrap();
        stalled.push(stream);
    }
    let answer = timed_get(
        &served.base,
        "/",
        &["Host: anywhere", &format!("Authorization: Bearer {token}")],
    );
    assert!(
        answer.as_ref().is_ok_and(|answer| status(answer) == 200),
        "with 12 unauthenticated clients holding their bodies back, the dashboard answered \
         {answer:?}"
    );
    drop(stalled);
}

/// A request line must not be read whole into memory, however long, before any check: an
/// unauthenticated client must not make the server hold as much memory as it sends.
#[test]
fn a_huge_request_line_is_not_held_in_memory() {
    let db = TestDb::migrated(Backend::Sqlite);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "a-long-enough-token-0123\n").unwrap();
    let served = Watched::start(db.url(), &["--token-file", file.path().to_str().unwrap()]);
    assert_eq!(
        status(&raw(
            &served.base,
            b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"
        )),
        401
    );
    let before = served.memory("VmHWM:");
    let sent: usize = 32 << 20;
    let mut stream = connect(&served.base);
    let mut line = b"GET /".to_vec();
    line.resize(sent, b'a');
    let _ = stream.write_all(&line);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    let grown = served.memory("VmHWM:").saturating_sub(before);
    assert!(
        grown < 8 * 1024,
        "the server's peak memory grew by {grown} kB for a {} MB request line",
        sent >> 20
    );
    assert_eq!(
        status(&raw(
            &served.base,
            b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"
        )),
        401
    );
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

/// Clients that open a connection and never finish their headers (slowloris), or never send
/// a small declared body, must not leave a new connection unanswered (the old server read
/// them on a pool of threads with no timeout, and a connection arriving in a burst could
/// queue behind ones that never end: in some rounds, not all, so ten rounds of eight slow
/// clients and one page).
#[test]
fn clients_slow_to_send_their_headers_do_not_stall_the_dashboard() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = serve(db.url(), &[], &[]);
    let mut slow = Vec::new();
    for round in 0..10 {
        for i in 0..8 {
            let mut stream = connect(&served.base);
            let part: &[u8] = match i % 3 {
                0 => b"GET / HTTP/1.1\r\nHost: local",
                1 => b"GE",
                _ => b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 500\r\n\r\nid=",
            };
            stream.write_all(part).unwrap();
            slow.push(stream);
        }
        let answer = timed_get(&served.base, "/", &["Host: localhost"]);
        assert!(
            answer.as_ref().is_ok_and(|answer| status(answer) == 200),
            "round {round}, with {} slow clients connected, a page got {answer:?}",
            slow.len()
        );
    }
    drop(slow);
}

/// NUL can be in no queue, kind or text tenure stores (names are checked), yet the jobs list
/// passes it to the database: PostgreSQL then fails the query (a 500 "Database error" for bad
/// input), the others say no job matches. Like an over-long filter, it should be a 400.
fn nul_in_a_jobs_filter_is_bad_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![])).unwrap();
    let served = serve(db.url(), &[], &[]);
    for path in ["/jobs?queue=a%00b", "/jobs?kind=a%00b", "/jobs?text=a%00b"] {
        let answer = get(&served.base, path);
        assert_eq!(answer.status, 400, "{backend} {path}: {}", answer.body);
        assert!(
            answer.body.contains("NUL"),
            "{backend} {path}: {}",
            answer.body
        );
    }
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

/// A request line saying HTTP/2.0 (or 3.0) must be answered and closed (the old server
/// deadlocked on it, keeping a thread and a file descriptor for good).
#[test]
fn an_http2_request_line_gets_an_answer_and_a_close() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = serve(db.url(), &[], &[]);
    for version in ["HTTP/2.0", "HTTP/3.0"] {
        let mut stream = connect(&served.base);
        stream
            .write_all(format!("GET / {version}\r\nHost: localhost\r\n\r\n").as_bytes())
            .unwrap();
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let read = stream.read_to_end(&mut out);
        assert!(
            read.is_ok(),
            "{version}: no answer and no close within {PATIENCE:?} ({read:?}), got {:?}",
            String::from_utf8_lossy(&out)
        );
    }
}

/// When the process runs out of file descriptors (many connections held open at once,
/// each sending a request that never ends), the dashboard must serve again once they are
/// gone: an accept error is waited out, never the end of the server.
#[test]
fn running_out_of_file_descriptors_does_not_stop_the_server_for_good() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = Watched::start_limited(db.url(), &[], 64);
    let mut held = Vec::new();
    for _ in 0..200 {
        let Ok(mut stream) = TcpStream::connect(addr(&served.base)) else {
            break;
        };
        let _ = stream.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n");
        held.push(stream);
    }
    assert!(held.len() > 64, "only {} connections were made", held.len());
    drop(held);
    let until = Instant::now() + PATIENCE;
    let last = loop {
        let answer = TcpStream::connect(addr(&served.base))
            .map_err(|e| e.to_string())
            .and_then(|_| {
                timed_get(&served.base, "/", &["Host: localhost"]).map_err(|e| e.to_string())
            });
        if answer.as_ref().is_ok_and(|a| status(a) == 200) || Instant::now() > until {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(
        last.as_ref().is_ok_and(|a| status(a) == 200),
        "after the connections closed, the dashboard answered {last:?}; the log:\n{}",
        served.log()
    );
    // The attack did what it is for: the server ran out of descriptors, and went on.
    let log = served.log();
    assert!(log.contains("cannot accept a connection"), "{log}");
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

/// Oddly formed requests get a 4xx/5xx or a closed connection, never a panic, and the
/// server serves on.
#[test]
fn slow_and_malformed_requests_do_not_stop_the_server() {
    let db = TestDb::migrated(Backend::Sqlite);
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let long_header = format!("X-Long: {}", "a".repeat(256 * 1024));
    let requests: Vec<Vec<u8>> = vec![
        b"GET / HTTP/9.9\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET /\r\n\r\n".to_vec(),
        b"GET\r\n\r\n".to_vec(),
        b"\r\n\r\n".to_vec(),
        b"GET  /  HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost localhost\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\n: empty-name\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHo st: localhost\r\n\r\n".to_vec(),
        b"GET /\xff\xfe HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: local\xc3\xa9\r\n\r\n".to_vec(),
        b"GET /\x00 HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET /jobs?queue=%FF%FE%00&state=%80 HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET /job?id=%ZZ HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: localhost\r\nExpect: 200-ok\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n".to_vec(),
        b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\nContent-Length: 700\r\n\r\nabc".to_vec(),
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n".to_vec(),
        b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot a chunk\r\n".to_vec(),
        b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nid=1&\r\n0\r\n\r\n".to_vec(),
        b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 4\r\n\r\nid=1GET / HTTP/1.1\r\n\r\n".to_vec(),
        b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 9\r\n\r\nid".to_vec(),
        b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\nid=1".to_vec(),
        b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 9\r\n\r\nid=%FF%00\xff\xfe".to_vec(),
        format!("GET /jobs?text={} HTTP/1.1\r\nHost: localhost\r\n\r\n", "%41".repeat(100_000)).into_bytes(),
        format!("GET / HTTP/1.1\r\nHost: localhost\r\n{long_header}\r\n\r\n").into_bytes(),
        format!("GET / HTTP/1.1\r\n{}Host: localhost\r\n\r\n", "X-A: b\r\n".repeat(5_000)).into_bytes(),
    ];
    for request in &requests {
        let answer = raw(base, request);
        let code = status(&answer);
        assert!(
            matches!(code, 0 | 100 | 200 | 400..=505),
            "{:?} got {answer:?}",
            String::from_utf8_lossy(&request[..request.len().min(200)])
        );
    }
    let answer = timed_get(base, "/", &["Host: localhost"]).expect("a page after all that");
    assert_eq!(status(&answer), 200, "{answer}");
    let log = served.log();
    assert!(!log.contains("panicked"), "{log}");
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

/// Names with NUL or too long, everywhere but the jobs list's filters: a 400 that says so,
/// and nothing changed.
fn nul_and_oversized_names_are_bad_input_everywhere_else(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let dead = dead_job(&mut conn, "q", "k", b"{}", "boom");
    lease::try_take(&mut conn, "l", Duration::from_secs(600), "me")
        .unwrap()
        .unwrap();
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let long = "n".repeat(10 * 1024);
    for path in [
        "/queue?name=q%00".to_string(),
        format!("/queue?name={long}"),
        "/lease/release?name=l%00".into(),
        format!("/lease/release?name={long}"),
    ] {
        let answer = get(base, &path);
        assert_eq!(
            answer.status,
            400,
            "{backend} {}: {}",
            &path[..path.len().min(40)],
            answer.body
        );
    }
    let token = csrf(&get(base, &format!("/job?id={dead}")).body);
    let nul = "q\0";
    let actions: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("/queue/pause", vec![("name", nul)]),
        ("/queue/pause", vec![("name", &long)]),
        ("/queue/resume", vec![("name", nul)]),
        ("/queue/retry-dead", vec![("name", "q"), ("kind", "k\0")]),
        ("/queue/retry-dead", vec![("name", "q\0"), ("kind", "k")]),
        ("/queue/retry-dead", vec![("name", "q"), ("kind", &long)]),
        ("/schedule/pause", vec![("name", "s\0")]),
        ("/schedule/resume", vec![("name", &long)]),
        ("/lease/release", vec![("name", "l\0"), ("confirm", "yes")]),
        ("/lease/release", vec![("name", &long), ("confirm", "yes")]),
    ];
    for (path, mut fields) in actions {
        fields.push(("csrf", &token));
        let answer = post(base, path, &fields);
        assert_eq!(answer.status, 400, "{backend} {path}: {}", answer.body);
        assert!(answer.body.contains("Bad request"), "{}", answer.body);
    }
    assert_eq!(state(&mut conn, dead), JobState::Dead);
    assert!(held(&mut conn, "l"));
    assert!(!jobs::is_paused(&mut conn, "q").unwrap());
}

/// Markup in every stored value the earlier tests do not cover (schedule names, queues and
/// kinds, lease names and holders on the confirmation page, limit keys, dedup keys, progress
/// messages, results, outputs, dead kinds), and a `javascript:` queue name in a link.
fn stored_markup_is_escaped_on_every_page(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let queue = "javascript:alert(1)//<svg onload=alert(1)>";
    let kind = "</pre></textarea><script>alert(1)</script>";
    let key = "]]><img src=x onerror=alert(1)>";
    let text = "\"><svg/onload=alert(1)></title><script>alert(1)</script>";
    let dead = dead_job(&mut conn, queue, kind, text.as_bytes(), text);
    let running = jobs::enqueue(
        &mut conn,
        &NewJob::new(queue, kind, vec![])
            .limit(key, 1)
            .dedup_key(key),
    )
    .unwrap()
    .id;
    let done = jobs::enqueue(&mut conn, &NewJob::new(queue, kind, vec![]))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, queue, 10, Duration::from_secs(600)).unwrap();
    for job in &claimed {
        if job.id == running {
            jobs::record_progress(&mut conn, job.claim(), 0.5, text).unwrap();
        } else if job.id == done {
            jobs::record_output(&mut conn, done, 1, Some(0), text.as_bytes()).unwrap();
            jobs::complete_with_result(
                &mut conn,
                job.claim(),
                &JobResult::bytes(text.as_bytes().to_vec()).unwrap(),
            )
            .unwrap();
        }
    }
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            key,
            Duration::from_secs(3600),
            NewJob::new(queue, kind, vec![]),
        ),
    )
    .unwrap();
    lease::try_take(&mut conn, key, Duration::from_secs(600), text)
        .unwrap()
        .unwrap();
    let served = serve(db.url(), &[], &[]);
    let pages = [
        "/".to_string(),
        "/jobs".into(),
        format!(
            "/jobs?queue={}&kind={}&text={}",
            encode(queue),
            encode(kind),
            encode(text)
        ),
        format!("/job?id={dead}"),
        format!("/job?id={running}"),
        format!("/job?id={done}"),
        format!("/queue?name={}", encode(queue)),
        "/leases".into(),
        format!("/lease/release?name={}", encode(key)),
        "/schedules".into(),
    ];
    for path in &pages {
        let page = get(&served.base, path);
        assert_eq!(page.status, 200, "{backend} {path}: {}", page.body);
        for bad in [
            "<svg onload",
            "<svg/onload",
            "<img",
            "<script>",
            "</textarea",
            "href=\"javascript:",
            "onload=alert(1)>",
        ] {
            assert!(
                !page.body.contains(bad),
                "{backend} {path} holds {bad:?} unescaped"
            );
        }
        assert_eq!(
            page.body.matches("<script").count(),
            1,
            "{backend} {path}: one script, the dashboard's"
        );
    }
    // The values are there, as text.
    let page = get(&served.base, &format!("/job?id={running}")).body;
    assert!(
        page.contains("]]&gt;&lt;img src=x onerror=alert(1)&gt;"),
        "{page}"
    );
    let page = get(&served.base, "/schedules").body;
    assert!(
        page.contains("href=\"/queue?name=javascript%3Aalert%281%29"),
        "{page}"
    );
    let page = get(&served.base, &format!("/job?id={done}")).body;
    assert!(
        page.matches("&lt;svg/onload=alert(1)&gt;").count() >= 2,
        "{page}"
    );
}

/// A database error is a 500 "Database error" page, never an empty list or "no such" page;
/// its log line names no URL; the other pages keep working, and on a server the dashboard
/// recovers when its connections are killed under it.
fn a_database_error_is_a_500_and_the_server_serves_on(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    lease::try_take(&mut conn, "l", Duration::from_secs(600), "me")
        .unwrap()
        .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "s",
            Duration::from_secs(3600),
            NewJob::new("q", "k", vec![]),
        ),
    )
    .unwrap();
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    for path in ["/leases", "/lease/release?name=l", "/schedules", "/"] {
        assert_eq!(get(base, path).status, 200, "{path}");
    }
    let token = csrf(&get(base, &format!("/job?id={id}")).body);
    conn.batch_execute("DROP TABLE tenure_leases").unwrap();
    for path in ["/leases", "/lease/release?name=l"] {
        let answer = get(base, path);
        assert_eq!(answer.status, 500, "{backend} {path}: {}", answer.body);
        assert!(answer.body.contains("Database error"), "{}", answer.body);
        assert!(!answer.body.contains("No lease"), "{}", answer.body);
        assert!(!answer.body.contains(db.url()), "{}", answer.body);
    }
    let answer = post(
        base,
        "/lease/release",
        &[("csrf", &token), ("name", "l"), ("confirm", "yes")],
    );
    assert_eq!(answer.status, 500, "{backend}: {}", answer.body);
    // The rest of the dashboard is untouched.
    assert_eq!(get(base, "/schedules").status, 200);
    assert_eq!(get(base, &format!("/job?id={id}")).status, 200);
    let log = served.log();
    assert!(log.contains("a page failed"), "{log}");
    assert!(log.contains("GET /leases 500"), "{log}");
    assert!(!log.contains(db.url()), "{log}");

    if backend != Backend::Sqlite {
        // Kill every connection the dashboard holds.
        let kill = match backend {
            Backend::Postgres => "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                                  WHERE datname = current_database() AND pid <> pg_backend_pid()"
                .to_string(),
            _ => {
                use diesel::prelude::*;
                #[derive(QueryableByName)]
                struct Id {
                    #[diesel(sql_type = diesel::sql_types::BigInt)]
                    id: i64,
                }
                let ids: Vec<Id> = diesel::sql_query(
                    "SELECT CAST(id AS SIGNED) AS id FROM information_schema.processlist \
                     WHERE db = DATABASE() AND id <> CONNECTION_ID()",
                )
                .load(&mut conn)
                .unwrap();
                assert!(!ids.is_empty(), "the dashboard holds connections");
                ids.iter()
                    .map(|row| format!("KILL {};", row.id))
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        };
        conn.batch_execute(&kill).unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let answer = get(base, "/schedules");
            assert!(
                matches!(answer.status, 200 | 500),
                "{backend}: {} {}",
                answer.status,
                answer.body
            );
            if answer.status == 200 {
                assert!(
                    answer.body.contains("data-schedule=\"s\""),
                    "{}",
                    answer.body
                );
                break;
            }
            assert!(
                Instant::now() < until,
                "{backend}: the dashboard did not recover: {}",
                answer.body
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        // Every handler thread gets its connection back.
        for _ in 0..8 {
            assert_eq!(get(base, &format!("/job?id={id}")).status, 200);
        }
    } else {
        // SQLite: another table gone under the pool's open connections.
        conn.batch_execute("DROP TABLE tenure_schedules").unwrap();
        let answer = get(base, "/schedules");
        assert_eq!(answer.status, 500, "{}", answer.body);
        assert!(!answer.body.contains("No schedules"), "{}", answer.body);
        assert_eq!(get(base, &format!("/job?id={id}")).status, 200);
    }
    let answer: Answer = get(base, "/");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(!served.log().contains("panicked"));
}

//! `tenure serve` against raw HTTP a browser would never send: huge declared bodies and request
//! lines, HTTP/2 request lines, clients slow to send (or never sending) their headers and
//! bodies, malformed requests, and file descriptors running out.
//!
//! Every request here is bounded by a socket timeout of tens of seconds, so a server that
//! stops answering fails a test instead of hanging it.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tenure::Backend;

use crate::common::{TestDb, poll_until};
use crate::dashboard::serve;

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
    let mut last = None;
    poll_until(PATIENCE, Duration::from_millis(250), || {
        let answer = TcpStream::connect(addr(&served.base))
            .map_err(|e| e.to_string())
            .and_then(|_| {
                timed_get(&served.base, "/", &["Host: localhost"]).map_err(|e| e.to_string())
            });
        let answered = answer.as_ref().is_ok_and(|a| status(a) == 200);
        last = Some(answer);
        answered.then_some(())
    });
    let last = last.expect("one try at least");
    assert!(
        last.as_ref().is_ok_and(|a| status(a) == 200),
        "after the connections closed, the dashboard answered {last:?}; the log:\n{}",
        served.log()
    );
    // The attack did what it is for: the server ran out of descriptors, and went on.
    let log = served.log();
    assert!(log.contains("cannot accept a connection"), "{log}");
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

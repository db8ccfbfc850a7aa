//! More attacks on `tenure serve`'s own HTTP server (`src/bin/tenure/serve/server.rs`): clients
//! that do not read their reply, or read it a drop at a time, floods of slow readers and of
//! whole requests, SIGTERM with work in flight, odd Content-Length spellings, heads at the
//! size limit, pipelining, resets, and the process's threads and memory under many
//! connections.
//!
//! Every wait here is bounded by a deadline of tens of seconds, so a server that stops
//! answering fails a test instead of hanging it.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::TestDb;

/// How long a test waits for any one answer: far longer than a loaded machine needs.
const PATIENCE: Duration = Duration::from_secs(30);

/// A `tenure serve` whose process id is known; killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: tempfile::NamedTempFile,
}

impl Server {
    fn start(url: &str, args: &[&str]) -> Server {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tenure"))
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
        let addr = first
            .split_whitespace()
            .find_map(|word| word.strip_prefix("http://"))
            .unwrap_or_else(|| panic!("tenure serve did not start: {first}"))
            .trim_end_matches('/')
            .parse()
            .unwrap();
        Server { child, addr, log }
    }

    /// A figure of `/proc/PID/status` (kB for memory).
    fn status_field(&self, field: &str) -> u64 {
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

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(self.addr).expect("connect to tenure serve");
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream.set_write_timeout(Some(PATIENCE)).unwrap();
        stream
    }

    /// Sends `request`, half-closes, and reads everything until the server closes.
    fn raw(&self, request: &[u8]) -> std::io::Result<String> {
        let mut stream = self.connect();
        let _ = stream.write_all(request);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        match stream.read_to_end(&mut out) {
            Ok(_) => Ok(String::from_utf8_lossy(&out).into_owned()),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                Ok(String::from_utf8_lossy(&out).into_owned())
            }
            Err(e) => Err(e),
        }
    }

    /// `GET path` with a loopback Host: the whole answer, or an error after `PATIENCE`.
    fn get(&self, path: &str) -> std::io::Result<String> {
        self.raw(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
    }

    /// Sends SIGTERM; how long until it exited, and how (None: not within `within`).
    fn terminate(&mut self, within: Duration) -> Option<(Duration, std::process::ExitStatus)> {
        let sent = Instant::now();
        let signalled = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(signalled.success());
        while sent.elapsed() < within {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some((sent.elapsed(), status));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status of a raw answer (0 when the server closed without one).
fn status(answer: &str) -> u16 {
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// A connection to `addr` whose receive window is as small as Linux allows (a tiny receive
/// buffer, a tiny segment size): what the server sends piles up in its own send buffer.
fn narrow_connect(addr: SocketAddr) -> TcpStream {
    let SocketAddr::V4(v4) = addr else {
        panic!("IPv4 only")
    };
    // SAFETY: plain socket calls on a descriptor this function owns until it hands it over.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let set = |level, name, value: libc::c_int| {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        set(libc::SOL_SOCKET, libc::SO_RCVBUF, 1);
        set(libc::IPPROTO_TCP, libc::TCP_MAXSEG, 536);
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let connected = libc::connect(
            fd,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert!(
            connected == 0,
            "connect: {}",
            std::io::Error::last_os_error()
        );
        let stream = TcpStream::from_raw_fd(fd);
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream.set_write_timeout(Some(PATIENCE)).unwrap();
        stream
    }
}

/// Makes closing `stream` send a reset (SO_LINGER with a zero timeout).
fn reset_on_close(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a socket option on a descriptor `stream` owns.
    let set = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0, "SO_LINGER: {}", std::io::Error::last_os_error());
}

/// A database with one job whose 64 KiB binary payload makes a page of a few hundred KB (a
/// hex dump); its id.
fn big_job(db: &TestDb) -> i64 {
    let mut conn = db.connect();
    let payload: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    jobs::enqueue(&mut conn, &NewJob::new("q", "k", payload))
        .unwrap()
        .id
}

/// The CPU time (user and system, in clock ticks) process `pid` has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// `GET path` on a new connection, answered whole within `limit` (or the read error).
fn get_within(addr: SocketAddr, path: &str, limit: Duration) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(limit))?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())?;
    let mut out = Vec::new();
    stream.read_to_end(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Waits (up to `PATIENCE`) until the log has `count` lines holding `needle` (a handler logs
/// a request when it has rendered it, before writing the reply).
fn await_log(server: &Server, needle: &str, count: usize) {
    let until = Instant::now() + PATIENCE;
    while server.log().matches(needle).count() < count {
        assert!(
            Instant::now() < until,
            "no {needle:?} logged {count} time(s) within {PATIENCE:?}:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------
// Promises broken (these fail).
// ---------------------------------------------------------------------------------------

/// "Slow or stuck clients hold readers, never the handlers every page needs": yet the
/// handler writes the reply itself, so a client that asks for a page larger than the socket
/// buffers (a job's page: 240 KB for a 64 KiB payload) and never reads holds that handler
/// for as long as the kernel lets a write wait (10 s per `write` call, and `write_all` makes
/// several: about 30 s here). Two such requests and one handler thread: a page waits a
/// minute. With the default four, eight connections a minute keep the dashboard down.
#[test]
fn a_client_that_never_reads_its_reply_holds_no_handler() {
    let db = TestDb::migrated(Backend::Sqlite);
    let id = big_job(&db);
    let server = Server::start(db.url(), &["--threads", "1"]);
    let request = format!("GET /job?id={id} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let mut stuck = Vec::new();
    for _ in 0..2 {
        let mut stream = narrow_connect(server.addr);
        stream.write_all(request.as_bytes()).unwrap();
        stuck.push(stream);
    }
    // The handler has rendered the first one and is writing it.
    await_log(&server, "/job 200", 1);
    let started = Instant::now();
    let answer = get_within(server.addr, "/", Duration::from_secs(15));
    assert!(
        answer.as_ref().is_ok_and(|answer| status(answer) == 200),
        "with two clients not reading their job page, GET / got {answer:?} after {:?}",
        started.elapsed()
    );
    drop(stuck);
}

/// "A reply is written within 10 s": the deadline is the socket's write timeout, which
/// bounds each `write` call, not the reply; every call that moves a byte starts a new 10 s.
/// A client that reads a kilobyte every half second gets the whole 240 KB page over minutes,
/// and holds the thread writing it all that time. After 15 s of that, a server that kept its
/// 10 s deadline has given up: what it wrote by then (what the client read, plus its socket
/// buffers, which are smaller than the page: see the test above) is all the client can get.
#[test]
fn a_reply_is_not_written_past_its_deadline_to_a_client_that_reads_a_drop_at_a_time() {
    let db = TestDb::migrated(Backend::Sqlite);
    let id = big_job(&db);
    let server = Server::start(db.url(), &[]);
    let mut stream = narrow_connect(server.addr);
    stream
        .write_all(format!("GET /job?id={id} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    while started.elapsed() < Duration::from_secs(15) {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let slowly = got.len();
    // Now as fast as it comes.
    let _ = stream.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    let (head, body) = text.split_once("\r\n\r\n").expect("a reply's head");
    let declared: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("Content-Length: "))
        .and_then(|n| n.parse().ok())
        .expect("a Content-Length");
    assert!(
        body.len() < declared,
        "the whole {declared}-byte page reached a client that had read {slowly} bytes in \
         its first 15 s: the server wrote for {:?}",
        started.elapsed()
    );
}

/// SIGTERM must stop the server promptly, but `serve` joins its handler threads, and a
/// handler writing to a client that does not read finishes only when the write gives up
/// (about 30 s here, forever for a client that reads a drop at a time: see above).
#[test]
fn sigterm_does_not_wait_for_a_client_that_never_reads() {
    let db = TestDb::migrated(Backend::Sqlite);
    let id = big_job(&db);
    let mut server = Server::start(db.url(), &[]);
    let mut stuck = narrow_connect(server.addr);
    stuck
        .write_all(format!("GET /job?id={id} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .unwrap();
    await_log(&server, "/job 200", 1);
    let exited = server.terminate(Duration::from_secs(15));
    assert!(
        exited.is_some_and(|(_, status)| status.success()),
        "15 s after SIGTERM, with one client not reading its page: {exited:?}\n{}",
        server.log()
    );
    drop(stuck);
}

/// `MAX_READERS` slow clients (each sends part of a head, and renews its connection every
/// 10 s) shut everyone else out: every connection beyond them is closed unread. 128
/// connections from one client take down the dashboard as long as it likes. A new
/// connection should rather push out the reader that has been waiting longest.
#[test]
fn slow_readers_at_the_limit_do_not_shut_out_a_real_request() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &[]);
    let mut slow = Vec::new();
    for _ in 0..140 {
        let mut stream = server.connect();
        stream.write_all(b"GET / HTTP/1.1\r\nHost: loc").unwrap();
        slow.push(stream);
    }
    let answer = get_within(server.addr, "/", PATIENCE);
    assert!(
        answer.as_ref().is_ok_and(|answer| status(answer) == 200),
        "with 140 slow clients connected, GET / got {answer:?}"
    );
    drop(slow);
}

/// `Content-Length = 1*DIGIT` (RFC 9110 8.6), and a server must refuse any other value with
/// a 400 (RFC 9112 6.3): the server trims the value as Unicode (a no-break space after the
/// digits passes) and parses it with Rust's `usize::from_str`, which takes a leading `+`.
/// Behind the reverse proxy the README recommends, a proxy that reads these differently
/// frames the body differently.
#[test]
fn a_content_length_that_is_not_all_digits_is_refused() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &[]);
    let mut taken = Vec::new();
    for value in [&b"+4"[..], b"4\xc2\xa0", b"\xe3\x80\x804"] {
        let mut request = b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: ".to_vec();
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n\r\nabcd");
        let answer = server.raw(&request).unwrap();
        if status(&answer) != 400 {
            taken.push(format!(
                "{:?}: {}",
                String::from_utf8_lossy(value),
                answer.lines().next().unwrap_or("")
            ));
        }
    }
    assert!(taken.is_empty(), "Content-Length values taken: {taken:#?}");
}

/// "Head ≤ 16 KiB": the size is checked only when a read ends without the head's end, and a
/// read takes up to 4 KiB, so a head of up to 20 KiB that arrives at once is taken.
#[test]
fn a_head_over_16_kib_is_refused_however_it_arrives() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &[]);
    let start = "GET / HTTP/1.1\r\nHost: localhost\r\nX-Pad: ";
    let mut taken = Vec::new();
    for over in [100, 3000] {
        let pad = "a".repeat(16 * 1024 + over - start.len() - 4);
        let request = format!("{start}{pad}\r\n\r\n");
        assert_eq!(request.len(), 16 * 1024 + over);
        let answer = server.raw(request.as_bytes()).unwrap();
        if status(&answer) != 431 {
            taken.push(format!(
                "a {}-byte head: {}",
                request.len(),
                answer.lines().next().unwrap_or("")
            ));
        }
    }
    assert!(taken.is_empty(), "{taken:#?}");
}

/// The reader looks for the head's end through the whole buffer after every read, so a
/// head that comes a byte at a time costs time quadratic in its length: eight clients
/// dripping 15 KB heads over 8 s keep the server's CPU busier than a core (some 9 s of CPU
/// in a debug build, where looking only at the new bytes costs well under one). 128 such
/// readers are allowed at once, on a 2-core machine.
#[test]
fn a_head_sent_a_byte_at_a_time_costs_little_cpu() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &[]);
    let before = cpu_ticks(server.child.id());
    let mut streams: Vec<TcpStream> = (0..8).map(|_| server.connect()).collect();
    for stream in &mut streams {
        stream.set_nodelay(true).unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\nX: ").unwrap();
    }
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(8) && sent < 15_000 {
        for stream in &mut streams {
            let _ = stream.write_all(b"a");
        }
        sent += 1;
        // 0.3 ms between bytes, so that most reads find one.
        let next = Instant::now() + Duration::from_micros(300);
        while Instant::now() < next {
            std::hint::spin_loop();
        }
    }
    let used = cpu_ticks(server.child.id()) - before;
    assert!(
        used < 300,
        "8 heads of {sent} bytes a byte at a time cost the server {used} ticks of CPU \
         (100 a second) in {:?}",
        started.elapsed()
    );
    drop(streams);
}

// ---------------------------------------------------------------------------------------
// Attacks the server withstands (these pass).
// ---------------------------------------------------------------------------------------

/// A flood of whole requests on one handler: each gets a 200 or a 503, none is dropped
/// unanswered, and the dashboard serves right after.
#[test]
fn a_flood_of_whole_requests_gets_answers_and_the_server_recovers() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &["--threads", "1"]);
    let addr = server.addr;
    let clients: Vec<_> = (0..16)
        .map(|_| {
            std::thread::spawn(move || {
                let mut codes = Vec::new();
                for _ in 0..20 {
                    let answer = get_within(addr, "/", PATIENCE);
                    codes.push(answer.map(|a| status(&a)).unwrap_or(1));
                }
                codes
            })
        })
        .collect();
    let codes: Vec<u16> = clients
        .into_iter()
        .flat_map(|client| client.join().unwrap())
        .collect();
    assert!(
        codes.iter().all(|code| matches!(code, 200 | 503)),
        "{codes:?}"
    );
    let answer = server.get("/").unwrap();
    assert_eq!(status(&answer), 200, "{answer}");
}

/// One request per connection whatever follows it; a client that resets at once, or
/// half-closes, leaves the server serving; odd Content-Length spellings, targets and header
/// names are refused or harmless.
#[test]
fn pipelining_resets_and_odd_framing_are_harmless() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &[]);
    // Pipelined: one answer, then the close.
    let answer = server
        .raw(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\nGET /leases HTTP/1.1\r\nHost: localhost\r\n\r\nPOST /job/cancel HTTP/1.1\r\n\r\n")
        .unwrap();
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer}");
    assert_eq!(status(&answer), 200);
    // Reset right after the request (SO_LINGER 0), many times.
    for _ in 0..50 {
        let mut stream = server.connect();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        reset_on_close(&stream);
    }
    for (request, expected) in [
        (&b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0x10\r\n\r\n"[..], 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1e1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4 4\r\n\r\nabcd", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4,4\r\n\r\nabcd", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 18446744073709551616\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\ncontent-length: 4\r\nCONTENT-LENGTH: 4\r\n\r\nabcd", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\ntransfer-encoding: identity\r\n\r\n", 411),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length:  4 \r\n\r\nabcd", 200),
        (b"GET /#fragment HTTP/1.1\r\nHost: localhost\r\n\r\n", 404),
        (b"GET /job?id=1#x HTTP/1.1\r\nHost: localhost\r\n\r\n", 400),
        (b"GET http://localhost/ HTTP/1.1\r\nHost: localhost\r\n\r\n", 404),
        (b"GET * HTTP/1.1\r\nHost: localhost\r\n\r\n", 404),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nX(y): z\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nX\xff: z\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\n X: folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: localhost\r\nX: a\r\n  folded\r\n\r\n", 400),
    ] {
        let answer = server.raw(request).unwrap();
        assert_eq!(
            status(&answer),
            expected,
            "{:?}: {}",
            String::from_utf8_lossy(request),
            answer.lines().next().unwrap_or("")
        );
    }
    // A space in the target: refused, as a bad line or a bad version.
    let answer = server
        .raw(b"GET / x HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    assert!(matches!(status(&answer), 400 | 505), "{answer}");
    let answer = server.get("/").unwrap();
    assert_eq!(status(&answer), 200, "{answer}");
    assert!(!server.log().contains("panicked"), "{}", server.log());
}

/// Many connections: slow readers beyond the limit, a head dripped a byte at a time, and a
/// thousand quick requests. The process's threads stay bounded (handlers, a thread per
/// open connection up to `MAX_CONNECTIONS`, a few more), a drip does not stretch the read deadline, the dashboard serves
/// again once the slow readers' deadline has passed, and memory does not grow with requests.
#[test]
fn many_connections_keep_threads_memory_and_deadlines_bounded() {
    let db = TestDb::migrated(Backend::Sqlite);
    let server = Server::start(db.url(), &[]);
    let addr = server.addr;
    for _ in 0..50 {
        assert_eq!(status(&server.get("/").unwrap()), 200);
    }
    let rss_before = server.status_field("VmRSS:");
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    // A drip: a byte every 100 ms, never a head's end.
    let drip = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream.write_all(b"GET / HTTP/1.1\r\nX: ").unwrap();
            let connected = Instant::now();
            while !stop.load(Ordering::SeqCst) && connected.elapsed() < PATIENCE {
                if stream.write_all(b"a").is_err() {
                    return Some(connected.elapsed());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            None
        })
    };
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut stream = TcpStream::connect(addr).unwrap();
        let _ = stream.write_all(b"GET / HTTP/1.1\r\nHost: loc");
        slow.push(stream);
    }
    let mut most_threads = server.status_field("Threads:");
    // A thousand quick connections, from 8 clients at once.
    let clients: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..125 {
                    let _ = get_within(addr, "/", PATIENCE);
                }
            })
        })
        .collect();
    while clients.iter().any(|client| !client.is_finished()) {
        most_threads = most_threads.max(server.status_field("Threads:"));
        std::thread::sleep(Duration::from_millis(10));
    }
    for client in clients {
        client.join().unwrap();
    }
    assert!(
        // Handlers, at most 256 connections (reading, waiting or writing), and a few of
        // the process's own.
        most_threads <= 4 + 256 + 16,
        "the server ran {most_threads} threads at once"
    );
    // The slow readers' deadline passes: the dashboard answers again.
    let until = started + PATIENCE;
    let answer = loop {
        let answer = get_within(addr, "/", PATIENCE);
        if answer.as_ref().is_ok_and(|a| status(a) == 200) || Instant::now() > until {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        answer.as_ref().is_ok_and(|a| status(a) == 200),
        "{:?} after the slow readers connected: {answer:?}",
        started.elapsed()
    );
    let dripped = drip.join().unwrap();
    assert!(
        dripped.is_some_and(|after| after < Duration::from_secs(25)),
        "a head dripped a byte every 100 ms was still being read after {dripped:?}"
    );
    stop.store(true, Ordering::SeqCst);
    drop(slow);
    for _ in 0..1000 {
        assert_eq!(status(&server.get("/").unwrap()), 200);
    }
    let grown = server.status_field("VmRSS:").saturating_sub(rss_before);
    assert!(
        grown < 16 * 1024,
        "the server's memory grew by {grown} kB over some 2,000 requests"
    );
}

/// SIGTERM with slow readers, a drip and queued requests in flight: the process exits 0 at
/// once (it waits for no reader), and the port is free again.
#[test]
fn sigterm_with_slow_readers_exits_at_once() {
    let db = TestDb::migrated(Backend::Sqlite);
    let mut server = Server::start(db.url(), &[]);
    let mut slow = Vec::new();
    for i in 0..100 {
        let mut stream = server.connect();
        let part: &[u8] = if i % 2 == 0 {
            b"GET / HTTP/1.1\r\nHost: loc"
        } else {
            b"POST /job/cancel HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\nid="
        };
        stream.write_all(part).unwrap();
        slow.push(stream);
    }
    assert_eq!(status(&server.get("/").unwrap()), 200);
    let exited = server.terminate(Duration::from_secs(8));
    assert!(
        exited.is_some_and(|(_, status)| status.success()),
        "8 s after SIGTERM, with 100 slow readers: {exited:?}\n{}",
        server.log()
    );
    let port_free = std::net::TcpListener::bind(server.addr);
    assert!(port_free.is_ok(), "{port_free:?}");
    drop(slow);
}

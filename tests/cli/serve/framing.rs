//! `tenure serve`'s own HTTP server and a request's framing: Content-Length digits only, a head
//! over 16 KiB refused however it arrives, a head sent a byte at a time cheap, and pipelining,
//! resets and odd framing harmless.
//!
//! Every wait here is bounded by a deadline of tens of seconds, so a server that stops
//! answering fails a test instead of hanging it.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tenure::Backend;

use crate::common::TestDb;

use super::raw_server::{Server, status};

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

/// The CPU time (user and system, in clock ticks) process `pid` has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
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

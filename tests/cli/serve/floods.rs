//! `tenure serve`'s own HTTP server under floods: of whole requests (answered, and the server
//! recovers) and of connections (threads, memory and deadlines stay bounded).
//!
//! Every wait here is bounded by a deadline of tens of seconds, so a server that stops
//! answering fails a test instead of hanging it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tenure::Backend;

use crate::common::TestDb;

use super::raw_server::{PATIENCE, Server, status};

/// `GET path` on a new connection, answered whole within `limit` (or the read error).
fn get_within(addr: SocketAddr, path: &str, limit: Duration) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(limit))?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())?;
    let mut out = Vec::new();
    stream.read_to_end(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
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

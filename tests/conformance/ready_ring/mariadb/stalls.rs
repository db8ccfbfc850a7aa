//! A rotation whose client stalls (a network stall, a stopped process) must not hold every
//! claim behind the ring's lock.

use tenure::jobs::{self, NewJob};
use tenure::{AnyConnection, Backend};

use super::super::NO_WAIT;
use super::timed_claim;
use crate::common::TestDb;

/// A TCP proxy to the test server that forwards everything, but holds the first client
/// packet containing `pattern` for `hold` (a slow or lossy network: TCP retransmits after
/// growing pauses; or a client frozen between two statements). Returns its port and a flag
/// set while it holds the packet.
fn holding_proxy(
    upstream: std::net::SocketAddr,
    pattern: &'static [u8],
    hold: std::time::Duration,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let holding = Arc::new(AtomicBool::new(false));
    let armed = Arc::new(AtomicBool::new(true));
    let flag = holding.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { return };
            let Ok(mut server) = TcpStream::connect(upstream) else {
                return;
            };
            let (mut client_in, mut server_out) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (armed, flag) = (armed.clone(), flag.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = match client_in.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let packet = &buf[..n];
                    if packet.windows(pattern.len()).any(|w| w == pattern)
                        && armed.swap(false, Ordering::SeqCst)
                    {
                        flag.store(true, Ordering::SeqCst);
                        std::thread::sleep(hold);
                        flag.store(false, Ordering::SeqCst);
                    }
                    if server_out.write_all(packet).is_err() {
                        break;
                    }
                }
                let _ = server_out.shutdown(std::net::Shutdown::Both);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut server, &mut client);
                let _ = client.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (port, holding)
}

/// A rotation never holds claims for long: a worker's rotation whose last statement
/// (`UNLOCK TABLES`) is held up on the way (the proxy above holds it ten seconds: a network
/// stall, or a process frozen between two statements) would keep the ring's table lock for
/// that long, and every claim and enqueue of the database would wait behind it (MariaDB's
/// metadata lock wait, `lock_wait_timeout`: a day by default), where claims otherwise skip
/// what others hold. The rotating session waits two seconds for its next statement, then
/// the server ends it and its lock: a claim on another connection waits less than six.
/// (Before: 5.0 s behind a five-second stall, as long as the stall.)
#[test]
fn mysql_a_stalled_rotation_does_not_stop_every_claim() {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    let backend = Backend::Mysql;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]))
        .unwrap()
        .id;
    let mut url = url::Url::parse(db.url()).unwrap();
    let upstream = (
        url.host_str().unwrap().to_string(),
        url.port().unwrap_or(3306),
    );
    let upstream = std::net::ToSocketAddrs::to_socket_addrs(&upstream)
        .unwrap()
        .next()
        .unwrap();
    let hold = Duration::from_secs(10);
    let (port, holding) = holding_proxy(upstream, b"UNLOCK TABLES", hold);
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(port)).unwrap();
    let mut stalled = AnyConnection::connect(url.as_str()).expect("through the proxy");
    let rotator = std::thread::spawn(move || jobs::rotate_ready(&mut stalled, NO_WAIT));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !holding.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the rotation never reached its UNLOCK"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (receiver, claimer) = timed_claim(&db);
    let waited = receiver.recv_timeout(Duration::from_secs(6));
    let rotated = rotator.join().unwrap();
    let taken = claimer.join().unwrap();
    println!("the rotation: {rotated:?}; the claim of job {id}: {taken:?}");
    let waited = waited.unwrap_or_else(|_| receiver.recv().unwrap());
    assert!(
        waited < Duration::from_secs(6),
        "a claim waited {waited:?} behind a rotation whose UNLOCK TABLES was held up {hold:?}"
    );
}

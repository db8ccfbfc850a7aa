//! A `tenure serve` process driven over raw sockets, for the attacks on its HTTP server
//! (`slow_readers`, `framing`, `floods`): its process id, its status line, raw requests and
//! answers, each bounded by a deadline.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a test waits for any one answer: far longer than a loaded machine needs.
pub(super) const PATIENCE: Duration = Duration::from_secs(30);

/// A `tenure serve` whose process id is known; killed when dropped.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) addr: SocketAddr,
    log: tempfile::NamedTempFile,
}

#[allow(dead_code)]
impl Server {
    pub(super) fn start(url: &str, args: &[&str]) -> Server {
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
    pub(super) fn status_field(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in {status}"))
    }

    pub(super) fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub(super) fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(self.addr).expect("connect to tenure serve");
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream.set_write_timeout(Some(PATIENCE)).unwrap();
        stream
    }

    /// Sends `request`, half-closes, and reads everything until the server closes.
    pub(super) fn raw(&self, request: &[u8]) -> std::io::Result<String> {
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
    pub(super) fn get(&self, path: &str) -> std::io::Result<String> {
        self.raw(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
    }

    /// Sends SIGTERM; how long until it exited, and how (None: not within `within`).
    pub(super) fn terminate(
        &mut self,
        within: Duration,
    ) -> Option<(Duration, std::process::ExitStatus)> {
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
pub(super) fn status(answer: &str) -> u16 {
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

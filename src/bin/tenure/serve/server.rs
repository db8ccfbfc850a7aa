//! The HTTP/1.1 server under the dashboard: std's sockets and httparse, with every limit an
//! exposed server needs. Each connection carries one request (`Connection: close`).
//!
//! Each connection has a thread of its own, which reads the request within
//! `READ_DEADLINE` (head at most `MAX_HEAD` bytes and `MAX_HEADERS` headers, body at most
//! `MAX_BODY` bytes by `Content-Length`, no chunked bodies), hands it to the handler
//! threads, and writes their reply within `WRITE_DEADLINE` (one deadline for the whole
//! reply). The handlers only render: no client, slow to send or to read, can hold one.
//! At most `MAX_READERS` connections are being read at once (a new one cuts off the oldest,
//! so clients that never finish cannot shut out those that do) and `MAX_CONNECTIONS` are
//! open. An error accepting a connection (out of file descriptors) is waited out, never the
//! end of the server.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::http::Reply;

/// The longest a client may take to send its whole request.
const READ_DEADLINE: Duration = Duration::from_secs(10);
/// The longest a reply may take to be written.
const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// The largest request line and headers.
const MAX_HEAD: usize = 16 * 1024;
/// The most headers.
const MAX_HEADERS: usize = 64;
/// The largest body (an action's form is a few hundred bytes).
pub const MAX_BODY: usize = 16 * 1024;
/// Connections being read at once; a new one past that cuts off the oldest.
const MAX_READERS: usize = 128;
/// Connections open at once, reading, waiting for their page or writing it; more are
/// closed unread.
const MAX_CONNECTIONS: usize = 256;
/// Requests read and waiting for a handler; more are answered 503.
const QUEUED: usize = 64;

/// A request read whole.
pub struct Request {
    pub method: String,
    /// The request target as sent (path and query).
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// A request and where its reply goes (back to the connection's own thread).
type Job = (Request, SyncSender<Reply>);

/// The connections being read, oldest first: when `MAX_READERS` are, the oldest is cut off
/// for a new one, so that clients that never finish cannot shut out those that do.
#[derive(Default)]
struct Reading {
    next: u64,
    streams: VecDeque<(u64, TcpStream)>,
}

impl Reading {
    fn add(reading: &Mutex<Reading>, stream: &TcpStream) -> u64 {
        let Ok(mut reading) = reading.lock() else {
            return 0;
        };
        if reading.streams.len() >= MAX_READERS {
            if let Some((_, oldest)) = reading.streams.pop_front() {
                let _ = oldest.shutdown(Shutdown::Both);
            }
        }
        reading.next += 1;
        let id = reading.next;
        if let Ok(clone) = stream.try_clone() {
            reading.streams.push_back((id, clone));
        }
        id
    }

    fn done(reading: &Mutex<Reading>, id: u64) {
        if let Ok(mut reading) = reading.lock() {
            reading.streams.retain(|(other, _)| *other != id);
        }
    }
}

/// Serves `handle` on `listener` with `threads` handler threads until `stop` is set.
pub fn serve<H>(listener: TcpListener, threads: u32, stop: Arc<AtomicBool>, handle: H)
where
    H: Fn(&Request) -> Reply + Send + Sync + 'static,
{
    let (queue, requests) = sync_channel::<Job>(QUEUED);
    let requests = Arc::new(Mutex::new(requests));
    let handle = Arc::new(handle);
    let handlers: Vec<_> = (0..threads)
        .map(|_| {
            let (requests, handle, stop) = (requests.clone(), handle.clone(), stop.clone());
            std::thread::spawn(move || handler(&requests, handle.as_ref(), &stop))
        })
        .collect();
    accept(&listener, &queue, &stop);
    drop(queue);
    // Handlers only render (connections' own threads read and write), so they end within
    // a page's time; connections still open end with the process.
    for handler in handlers {
        let _ = handler.join();
    }
}

/// Renders replies; never touches a socket, so no client can hold it.
fn handler<H: Fn(&Request) -> Reply>(
    requests: &Mutex<Receiver<Job>>,
    handle: &H,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::SeqCst) {
        let next = match requests.lock() {
            Ok(requests) => requests.recv_timeout(Duration::from_millis(250)),
            Err(_) => return,
        };
        match next {
            Ok((request, reply_to)) => {
                let reply =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(&request)))
                        .unwrap_or_else(|_| Reply::text(500, "the page failed"));
                let _ = reply_to.send(reply);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

fn accept(listener: &TcpListener, queue: &SyncSender<Job>, stop: &AtomicBool) {
    let reading = Arc::new(Mutex::new(Reading::default()));
    let connections = Arc::new(AtomicUsize::new(0));
    let mut last_warning: Option<Instant> = None;
    // A blocking accept: whoever sets `stop` connects once to wake it (see `wake`).
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, a connection reset before it was accepted...:
                // wait and go on (once a minute in the log).
                if last_warning.is_none_or(|at| at.elapsed() > Duration::from_secs(60)) {
                    tracing::warn!(target: "tenure::serve", "cannot accept a connection: {e}");
                    last_warning = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if stop.load(Ordering::SeqCst) {
            break;
        }
        if connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            // Every thread is a connection waiting for its page or writing it (readers
            // beyond `MAX_READERS` are cut off): this one is closed unread.
            connections.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let id = Reading::add(&reading, &stream);
        let (mine, open, queue) = (reading.clone(), connections.clone(), queue.clone());
        let spawned = std::thread::Builder::new().spawn(move || {
            let read = read_request(&stream);
            Reading::done(&mine, id);
            match read {
                Ok(request) => {
                    let head_only = request.method == "HEAD";
                    let (reply_to, reply) = sync_channel(1);
                    let reply = match queue.try_send((request, reply_to)) {
                        Ok(()) => reply
                            .recv()
                            .unwrap_or_else(|_| Reply::text(503, "stopping")),
                        Err(_) => Reply::text(503, "busy: try again"),
                    };
                    write_reply(stream, reply, head_only);
                }
                Err(Some(reply)) => write_reply(stream, reply, false),
                Err(None) => {}
            }
            open.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            // No thread to serve it: the connection was closed with the closure.
            Reading::done(&reading, id);
            connections.fetch_sub(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Stops a [`serve`] on `address`: sets `stop`, then connects once so that its blocking
/// accept returns and sees it.
pub fn wake(address: std::net::SocketAddr, stop: &AtomicBool) {
    stop.store(true, Ordering::SeqCst);
    let _ = TcpStream::connect_timeout(&address, Duration::from_secs(1));
}

/// Reads one request within the limits; `Err(Some(reply))` to refuse it with a reply,
/// `Err(None)` to close without one (the client is gone or too slow).
fn read_request(mut stream: &TcpStream) -> Result<Request, Option<Reply>> {
    let deadline = Instant::now() + READ_DEADLINE;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let mut buffer = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    // Where the search for the head's end goes on from: each byte is looked at once (a
    // head dripped a byte at a time must not cost its length squared).
    let mut searched = 0;
    let head_end = loop {
        if let Some(at) = buffer[searched..].windows(4).position(|w| w == b"\r\n\r\n") {
            break searched + at + 4;
        }
        searched = buffer.len().saturating_sub(3);
        if buffer.len() > MAX_HEAD {
            return Err(Some(Reply::text(431, "the request's head is too large")));
        }
        let n = read_some(&mut stream, &mut chunk, deadline)?;
        buffer.extend_from_slice(&chunk[..n]);
    };
    if head_end > MAX_HEAD {
        return Err(Some(Reply::text(431, "the request's head is too large")));
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut headers);
    match parsed.parse(&buffer[..head_end]) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(Some(Reply::text(400, "a malformed request"))),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Some(Reply::text(431, "too many headers")));
        }
        Err(httparse::Error::Version) => {
            return Err(Some(Reply::text(505, "HTTP/1.1 only")));
        }
        Err(_) => return Err(Some(Reply::text(400, "a malformed request"))),
    }
    let method = parsed.method.unwrap_or("").to_string();
    let target = parsed.path.unwrap_or("").to_string();
    let headers: Vec<(String, String)> = parsed
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_string(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    let named = |name: &'static str| -> Vec<&str> {
        headers
            .iter()
            .filter(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
            .collect()
    };
    if !named("Transfer-Encoding").is_empty() {
        return Err(Some(Reply::text(
            411,
            "send the body with a Content-Length",
        )));
    }
    let lengths = named("Content-Length");
    let length = match lengths.as_slice() {
        [] => 0,
        // Digits only (RFC 9110), around them only spaces and tabs: no sign, no other
        // white space, as a proxy in front may read them differently.
        [one] => Some(one.trim_matches([' ', '\t']))
            .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|digits| digits.parse::<usize>().ok())
            .ok_or(Some(Reply::text(400, "a malformed Content-Length")))?,
        _ => return Err(Some(Reply::text(400, "more than one Content-Length"))),
    };
    if length > MAX_BODY {
        return Err(Some(Reply::text(413, "the request's body is too large")));
    }
    let mut body = buffer[head_end..].to_vec();
    while body.len() < length {
        let n = read_some(&mut stream, &mut chunk, deadline)?;
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(Request {
        method,
        target,
        headers,
        body,
    })
}

/// One read, waiting at most until `deadline`; the client gone or too slow is `Err(None)`.
fn read_some(
    stream: &mut &TcpStream,
    chunk: &mut [u8],
    deadline: Instant,
) -> Result<usize, Option<Reply>> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
        return Err(None);
    }
    match stream.read(chunk) {
        Ok(0) | Err(_) => Err(None),
        Ok(n) => Ok(n),
    }
}

fn write_reply(mut stream: TcpStream, reply: Reply, head_only: bool) {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        reply.status,
        reason(reply.status),
        reply.content_type,
        reply.body.len()
    )
    .into_bytes();
    for (name, value) in super::http::SECURITY_HEADERS {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    for (name, value) in &reply.headers {
        // Values are tenure's own (a Location built by `link`): never a line break, but a
        // header must not be split whatever it holds.
        if !value.contains(['\r', '\n']) {
            out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
    }
    out.extend_from_slice(b"\r\n");
    if !head_only {
        out.extend_from_slice(&reply.body);
    }
    // One deadline for the whole reply (a timeout per write would start again with every
    // byte a slow reader takes).
    let deadline = Instant::now() + WRITE_DEADLINE;
    let mut written = 0;
    while written < out.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
            return;
        }
        match stream.write(&out[written..]) {
            Ok(0) | Err(_) => return,
            Ok(n) => written += n,
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
    // Read what the client sent beyond its request and is already here (a bounded amount,
    // without waiting): closing with unread bytes would reset the connection, and the
    // client could lose the reply.
    let _ = stream.set_nonblocking(true);
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < 4 * MAX_BODY {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        303 => "See Other",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

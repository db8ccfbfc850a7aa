//! A TCP proxy in front of a test server, for a client whose link misbehaves while its
//! process lives: every connection through it shut down at once (`kill_all`: the server sees
//! those sessions end; new ones still pass), the client cut off (`cut`: new ones are refused
//! too, until `restore`), or a slow and then hung link for the connections made from some
//! moment on (`arm_slow`, `freeze`).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::Backend;

#[derive(Default)]
struct Flags {
    cut: AtomicBool,
    /// Connections accepted while set get `slow` on what the server sends.
    armed: AtomicBool,
    /// Armed connections pass nothing more from the server while set.
    frozen: AtomicBool,
    slow: Mutex<Duration>,
    open: Mutex<Vec<TcpStream>>,
}

pub struct TestProxy {
    /// The test database's URL through the proxy.
    pub url: String,
    flags: Arc<Flags>,
}

impl TestProxy {
    pub fn start(url: &str, backend: Backend) -> TestProxy {
        let mut parsed = url::Url::parse(url).expect("a server URL");
        let port = parsed.port().unwrap_or(match backend {
            Backend::Postgres => 5432,
            _ => 3306,
        });
        let upstream = format!("{}:{port}", parsed.host_str().expect("a host"));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        parsed.set_host(Some("127.0.0.1")).unwrap();
        parsed
            .set_port(Some(listener.local_addr().unwrap().port()))
            .unwrap();
        let flags = Arc::new(Flags::default());
        let shared = flags.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if shared.cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                {
                    let mut open = shared.open.lock().unwrap();
                    open.push(client.try_clone().unwrap());
                    open.push(server.try_clone().unwrap());
                }
                let slow = shared
                    .armed
                    .load(Ordering::SeqCst)
                    .then(|| (*shared.slow.lock().unwrap(), shared.clone()));
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || pump(c2, s2, None));
                std::thread::spawn(move || pump(server, client, slow));
            }
        });
        TestProxy {
            url: parsed.to_string(),
            flags,
        }
    }

    /// Shuts every connection through the proxy down; new ones still pass.
    pub fn kill_all(&self) {
        for socket in self.flags.open.lock().unwrap().drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    /// Shuts every connection down and refuses new ones from now on.
    pub fn cut(&self) {
        self.flags.cut.store(true, Ordering::SeqCst);
        self.kill_all();
    }

    /// Lets new connections pass again after [`TestProxy::cut`] (the server is back).
    #[allow(dead_code)]
    pub fn restore(&self) {
        self.flags.cut.store(false, Ordering::SeqCst);
    }

    /// Connections accepted from now on get `delay` on each chunk the server sends (earlier
    /// ones stay fast).
    pub fn arm_slow(&self, delay: Duration) {
        *self.flags.slow.lock().unwrap() = delay;
        self.flags.armed.store(true, Ordering::SeqCst);
    }

    /// The slow connections pass nothing more from the server (a hung link).
    pub fn freeze(&self) {
        self.flags.frozen.store(true, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, slow: Option<(Duration, Arc<Flags>)>) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((delay, flags)) = &slow {
            std::thread::sleep(*delay);
            while flags.frozen.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

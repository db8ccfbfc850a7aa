//! A TCP proxy in front of a test server that can cut its clients off for good: every
//! connection through it is shut down (the server sees its sessions end) and new ones are
//! refused, while the clients' process lives on. A network cut, or a firewall rule, as a
//! holder of a session lock meets it.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tenure::Backend;

pub struct CutProxy {
    /// The test database's URL through the proxy.
    pub url: String,
    cut: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl CutProxy {
    pub fn start(url: &str, backend: Backend) -> CutProxy {
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
        let cut = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (flag, sockets) = (cut.clone(), open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if flag.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                {
                    let mut sockets = sockets.lock().unwrap();
                    sockets.push(client.try_clone().unwrap());
                    sockets.push(server.try_clone().unwrap());
                }
                let pairs = [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ];
                for (from, to) in pairs {
                    std::thread::spawn(move || pump(from, to));
                }
            }
        });
        CutProxy {
            url: parsed.to_string(),
            cut,
            open,
        }
    }

    /// Cuts every connection through the proxy and refuses new ones from now on.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for socket in self.open.lock().unwrap().drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

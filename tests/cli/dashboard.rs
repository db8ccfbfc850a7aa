//! A `tenure serve` process for the dashboard's tests, and an HTTP client that follows no
//! redirect and takes every status as an answer.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running `tenure serve`; killed when dropped.
pub struct Served {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Its stderr (a file, so that a long run never blocks on a full pipe).
    log: tempfile::NamedTempFile,
}

impl Served {
    /// Sends SIGTERM and waits (up to a minute) for the exit; its status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let signalled = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(signalled.success());
        crate::common::poll_until(
            std::time::Duration::from_secs(60),
            std::time::Duration::from_millis(50),
            || self.child.try_wait().ok().flatten(),
        )
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tenure serve` on a free loopback port (unless `args` has a `--listen`) with `args` and `env`, and waits for the line
/// that says where it listens. Panics with its stderr if it exits first.
pub fn serve(url: &str, args: &[&str], env: &[(&str, &str)]) -> Served {
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let mut command = Command::new(env!("CARGO_BIN_EXE_tenure"));
    command
        .args(["--database-url", url, "serve"])
        .args(if args.contains(&"--listen") {
            &[][..]
        } else {
            &["--listen", "127.0.0.1:0"][..]
        })
        .args(args)
        .env_remove("TENURE_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .env_remove("TENURE_SERVE_TOKEN")
        .env_remove("TENURE_SERVE_BASIC_AUTH")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.reopen().expect("the log file"));
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("run tenure serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut first = String::new();
    BufReader::new(stdout)
        .read_line(&mut first)
        .expect("read tenure serve's first line");
    let Some(base) = first
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .map(|address| address.trim_end_matches('/').to_string())
    else {
        let status = child.wait().expect("wait for tenure serve");
        let said = std::fs::read_to_string(log.path()).unwrap_or_default();
        panic!("tenure serve did not start ({status:?}): {first}{said}");
    };
    Served { child, base, log }
}

/// What came back.
pub struct Answer {
    pub status: u16,
    pub body: String,
    pub headers: Vec<(String, String)>,
}

impl Answer {
    /// The value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into()
}

fn answer(response: ureq::http::Response<ureq::Body>) -> Answer {
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(name, value)| {
            (
                name.to_string(),
                value.to_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let body = response
        .into_body()
        .read_to_string()
        .expect("read the body");
    Answer {
        status,
        body,
        headers,
    }
}

/// `GET base + path` with extra headers.
pub fn get_with(base: &str, path: &str, headers: &[(&str, &str)]) -> Answer {
    let mut request = agent().get(format!("{base}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    answer(request.call().expect("GET"))
}

/// `GET base + path`.
pub fn get(base: &str, path: &str) -> Answer {
    get_with(base, path, &[])
}

/// A form POST to `base + path` with extra headers.
pub fn post_with(
    base: &str,
    path: &str,
    fields: &[(&str, &str)],
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = agent().post(format!("{base}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    answer(request.send_form(fields.iter().copied()).expect("POST"))
}

/// A form POST to `base + path`.
pub fn post(base: &str, path: &str, fields: &[(&str, &str)]) -> Answer {
    post_with(base, path, fields, &[])
}

/// The CSRF token in a page's forms.
pub fn csrf(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("the page has an action form")
        + "name=\"csrf\" value=\"".len();
    page[at..].split('"').next().unwrap_or("").to_string()
}

//! A small blocking W3C WebDriver client for headless Chromium: chromedriver on a free
//! loopback port, one session, the few commands the dashboard's browser tests use.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};

use crate::common::poll_until;

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";
/// The key under which WebDriver names an element.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How long anything may take on a loaded 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// chromedriver and one headless Chromium session; both end when dropped.
pub struct Browser {
    driver: Child,
    url: String,
    session: String,
    agent: ureq::Agent,
    // Chromium's profile; removed after chromedriver is gone.
    _profile: tempfile::TempDir,
}

/// An element of the current page.
#[derive(Clone, Debug)]
pub struct Element(String);

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        // Loopback only: a proxy from the environment must not get in the way.
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind a free loopback port")
        .port()
}

/// The WebDriver reply's `value`, or a panic with the driver's error.
fn value(what: &str, response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Value {
    let response = response.unwrap_or_else(|e| panic!("WebDriver {what}: {e}"));
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .with_config()
        .limit(64 * 1024 * 1024)
        .read_to_string()
        .unwrap_or_else(|e| panic!("WebDriver {what}: reading the reply: {e}"));
    let reply: Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("WebDriver {what}: {e} in {body}"));
    if status != 200 {
        panic!("WebDriver {what}: HTTP {status}: {}", reply["value"]);
    }
    reply["value"].clone()
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session. Panics (never skips) when either
    /// is missing.
    pub fn start() -> Browser {
        for program in [CHROMEDRIVER, CHROMIUM] {
            assert!(
                Path::new(program).exists(),
                "{program} is missing: install chromium and chromium-driver: scripts/test does"
            );
        }
        let agent = agent();
        // The port is free when picked but may be taken before chromedriver binds it: then
        // chromedriver exits, and another port is tried.
        let mut attempts = 0;
        let (driver, url) = loop {
            attempts += 1;
            let port = free_port();
            let mut driver = Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot run {CHROMEDRIVER} ({e}): install chromium and chromium-driver: \
                         scripts/test does"
                    )
                });
            let url = format!("http://127.0.0.1:{port}");
            let ready = poll_until(DEADLINE, Duration::from_millis(50), || {
                if let Ok(Some(status)) = driver.try_wait() {
                    assert!(attempts < 5, "chromedriver keeps exiting: {status}");
                    return Some(false);
                }
                let status = agent.get(format!("{url}/status")).call();
                if let Ok(response) = status
                    && let Ok(body) = response.into_body().read_to_string()
                    && serde_json::from_str::<Value>(&body)
                        .is_ok_and(|reply| reply["value"]["ready"] == true)
                {
                    return Some(true);
                }
                None
            })
            .unwrap_or_else(|| {
                let _ = driver.kill();
                let _ = driver.wait();
                panic!("chromedriver on port {port} was not ready within {DEADLINE:?}");
            });
            if ready {
                break (driver, url);
            }
        };
        let profile = tempfile::tempdir().expect("a profile directory");
        let mut browser = Browser {
            driver,
            url,
            session: String::new(),
            agent,
            _profile: profile,
        };
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--no-proxy-server".into(),
            "--window-size=1280,900".into(),
            format!("--user-data-dir={}", browser._profile.path().display()),
        ];
        let capabilities = json!({
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "pageLoadStrategy": "normal",
                    "timeouts": { "pageLoad": 60_000, "script": 30_000, "implicit": 0 },
                    "goog:chromeOptions": { "binary": CHROMIUM, "args": args },
                }
            }
        });
        let session = value(
            "new session",
            browser
                .agent
                .post(format!("{}/session", browser.url))
                .header("Content-Type", "application/json")
                .send(capabilities.to_string()),
        );
        browser.session = session["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {session}"))
            .to_string();
        browser
    }

    fn endpoint(&self, path: &str) -> String {
        format!("{}/session/{}{path}", self.url, self.session)
    }

    fn post(&self, what: &str, path: &str, body: Value) -> Value {
        value(
            what,
            self.agent
                .post(self.endpoint(path))
                .header("Content-Type", "application/json")
                .send(body.to_string()),
        )
    }

    fn get(&self, what: &str, path: &str) -> Value {
        value(what, self.agent.get(self.endpoint(path)).call())
    }

    /// Loads `url` (and waits for its load event).
    pub fn navigate(&self, url: &str) {
        self.post(&format!("navigate to {url}"), "/url", json!({ "url": url }));
    }

    /// The current page's URL.
    pub fn current_url(&self) -> String {
        self.get("current URL", "/url")
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Every element matching the CSS `selector`, now.
    pub fn find_all(&self, selector: &str) -> Vec<Element> {
        let found = self.post(
            &format!("find {selector}"),
            "/elements",
            json!({ "using": "css selector", "value": selector }),
        );
        found
            .as_array()
            .map(|all| {
                all.iter()
                    .filter_map(|e| e[ELEMENT].as_str())
                    .map(|id| Element(id.to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The first element matching `selector`, waited for until `DEADLINE`.
    pub fn find(&self, selector: &str) -> Element {
        poll_until(DEADLINE, Duration::from_millis(50), || {
            self.find_all(selector).into_iter().next()
        })
        .unwrap_or_else(|| {
            panic!(
                "no {selector} on {} within {DEADLINE:?}; the page says:\n{}",
                self.current_url(),
                self.page_text()
            )
        })
    }

    /// Waits until the current URL satisfies `wanted`, and gives it.
    pub fn wait_for_url(&self, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let mut url = String::new();
        poll_until(DEADLINE, Duration::from_millis(50), || {
            url = self.current_url();
            wanted(&url).then(|| url.clone())
        })
        .unwrap_or_else(|| {
            panic!(
                "the URL is still {url} after {DEADLINE:?}, not {what}; the page says:\n{}",
                self.page_text()
            )
        })
    }

    /// Clicks `element`.
    pub fn click(&self, element: &Element) {
        self.post("click", &format!("/element/{}/click", element.0), json!({}));
    }

    /// `element`'s rendered text.
    pub fn text(&self, element: &Element) -> String {
        self.get("element text", &format!("/element/{}/text", element.0))
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// `element`'s attribute `name`, if it has one.
    pub fn attribute(&self, element: &Element, name: &str) -> Option<String> {
        self.get(
            &format!("attribute {name}"),
            &format!("/element/{}/attribute/{name}", element.0),
        )
        .as_str()
        .map(str::to_string)
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page and gives what it
    /// returns (a returned promise is awaited).
    pub fn execute(&self, script: &str, args: Value) -> Value {
        self.post(
            "execute script",
            "/execute/sync",
            json!({ "script": script, "args": args }),
        )
    }

    /// The whole page's visible text.
    pub fn page_text(&self) -> String {
        self.execute(
            "return document.body ? document.body.innerText : ''",
            json!([]),
        )
        .as_str()
        .unwrap_or_default()
        .to_string()
    }

    /// Saves a PNG of the whole page (not only the viewport: a job's failed runs are below
    /// it) to `path`, through Chromium's DevTools command.
    pub fn screenshot(&self, path: &Path) {
        let size = self.execute(
            "var d = document.documentElement;
             return [d.scrollWidth, Math.max(d.scrollHeight, window.innerHeight)];",
            json!([]),
        );
        let shot = self.post(
            "screenshot",
            "/goog/cdp/execute",
            json!({
                "cmd": "Page.captureScreenshot",
                "params": {
                    "format": "png",
                    "captureBeyondViewport": true,
                    "clip": { "x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1 },
                },
            }),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap_or_default())
            .expect("a base64 screenshot");
        assert!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("create the screenshot directory");
        }
        std::fs::write(path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            // Ends Chromium; chromedriver itself is killed after.
            let _ = self.agent.delete(self.endpoint("")).call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

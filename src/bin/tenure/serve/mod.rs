//! `tenure serve`: a dashboard in the browser, served by a small blocking HTTP server
//! (`server.rs`) on a few threads, each page rendered on the server from bounded queries.
//!
//! Safety: it listens on loopback unless credentials are set (an access token or basic auth,
//! from the environment or a file); unguarded, it answers only loopback Host names (against
//! DNS rebinding). Every action is a POST carrying the process's CSRF token, refused from
//! another origin, and refused altogether with `--read-only`. Every value from the database
//! is escaped (maud), and every reply forbids framing, inline script and sniffing.

mod access;
mod http;
mod jobs;
mod layout;
mod leases;
mod parked;
mod queues;
mod schedules;
mod server;
mod workers;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::Args;
use maud::html;
use tenure::{AnyConnection, Backend, Error, Pool};

use crate::{Failure, Outcome, database};
use access::{Access, Sources, Verdict};
use http::{Incoming, Reply};
use server::Request;

/// What `tenure serve --help` says after the flags.
pub const ABOUT: &str = "\
Serves a dashboard of queues, jobs, leases, schedules and workers, with actions (retry,
cancel, pause, resume, force-release, answer a parked job), until Ctrl-C or SIGTERM.

PARKED JOBS' CALLBACKS: POST /callbacks/parked/complete (or fail, resume) with the job's
park token in the Tenure-Park-Token header answers the job; the body is the result or value
as JSON (complete, resume; may be empty) or the error text (fail). The token is the only
credential asked; every refused token gets 403 alike; tokens are never logged.

RUNNING IT SAFELY: it listens on 127.0.0.1 by default and then answers only requests
addressed to a loopback name. To listen anywhere else it needs credentials: an access token
in TENURE_SERVE_TOKEN (or a file given with --token-file), which a browser gives as the
basic-auth password (any user name) and a script as `Authorization: Bearer TOKEN`; or
`user:password` in TENURE_SERVE_BASIC_AUTH (or --basic-auth-file). At least 16 characters;
never on the command line, where other users see it. Serve it over HTTPS through a reverse
proxy when it leaves the machine (basic auth is sent with every request). --read-only hides
and refuses every action.";

#[derive(Args)]
pub struct ServeArgs {
    /// The address and port to listen on (port 0: any free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Show everything, change nothing: no action is offered or accepted.
    #[arg(long)]
    read_only: bool,
    /// A file holding the access token (instead of TENURE_SERVE_TOKEN).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// A file holding `user:password` for basic auth (instead of TENURE_SERVE_BASIC_AUTH).
    #[arg(long, value_name = "PATH")]
    basic_auth_file: Option<PathBuf>,
    /// Requests served at once (each with its own database connection).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
}

/// What every page needs.
pub struct Dashboard {
    pool: Pool,
    access: Access,
    read_only: bool,
    backend: Backend,
}

/// Runs the dashboard until Ctrl-C or SIGTERM.
pub fn run(target: &database::Target, args: ServeArgs) -> Outcome {
    let listen = resolve(&args.listen)?;
    let access = Access::configure(
        Sources {
            token_file: args.token_file.as_deref(),
            basic_auth_file: args.basic_auth_file.as_deref(),
        },
        listen,
    )?;
    let pool = database::open(target, args.threads, true)?;
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|e| Failure::new(1, format!("cannot listen on {listen}: {e}")))?;
    let local = listener.local_addr().unwrap_or(listen);
    let bound = local.to_string();
    crate::work::init_logging(crate::work::LogFormat::Human);
    let dashboard = Arc::new(Dashboard {
        backend: pool.backend(),
        pool,
        access,
        read_only: args.read_only,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    // Listening on every address, the wake-up connects to loopback on the same port.
    let wake_at = match local.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), local.port())
        }
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), local.port())
        }
        _ => local,
    };
    ctrlc::set_handler(move || server::wake(wake_at, &stopping))
        .map_err(|e| Failure::new(1, format!("cannot handle Ctrl-C: {e}")))?;
    crate::output::line(&format!(
        "tenure serve: http://{bound}/ ({}{}{})",
        dashboard.backend,
        if dashboard.access.guarded() {
            ", credentials required"
        } else {
            ""
        },
        if args.read_only { ", read-only" } else { "" }
    ))?;
    server::serve(listener, args.threads, stop, move |request| {
        handle(&dashboard, request)
    });
    Ok(())
}

fn resolve(listen: &str) -> Result<SocketAddr, Failure> {
    if let Ok(addr) = listen.parse::<SocketAddr>() {
        return Ok(addr);
    }
    listen
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .ok_or_else(|| Failure::new(2, format!("--listen {listen:?} is not an address:port")))
}

/// Answers one request and logs it (method, path with its control characters escaped,
/// status, time; never its query, form or credentials).
fn handle(dashboard: &Dashboard, request: &Request) -> Reply {
    let started = Instant::now();
    let reply = respond(dashboard, request);
    let path = request.target.split('?').next().unwrap_or("");
    tracing::info!(
        target: "tenure::serve",
        "{} {} {} {} ms",
        request.method.escape_debug(),
        path.escape_debug(),
        reply.status,
        started.elapsed().as_millis()
    );
    reply
}

fn respond(dashboard: &Dashboard, request: &Request) -> Reply {
    // A park's callback: its token is its credential (see `parked.rs`).
    if request.target.starts_with(parked::CALLBACKS) {
        return parked::callback(dashboard, request);
    }
    match dashboard
        .access
        .admits(request.header("Authorization"), request.header("Host"))
    {
        Verdict::Admitted => {}
        Verdict::Unauthorized => {
            let mut reply = Reply::text(401, "credentials required");
            reply.headers.push((
                "WWW-Authenticate",
                "Basic realm=\"tenure\", charset=\"UTF-8\"".to_string(),
            ));
            return reply;
        }
        Verdict::WrongHost => {
            return Reply::text(
                421,
                "this dashboard answers only to localhost (set credentials to serve other names)",
            );
        }
    }
    if !matches!(request.method.as_str(), "GET" | "HEAD" | "POST") {
        return Reply::text(405, "only GET, HEAD and POST");
    }
    let incoming = match Incoming::read(request) {
        Ok(incoming) => incoming,
        Err(reply) => return reply,
    };
    if incoming.post {
        if let Err(reply) = check_action(dashboard, request, &incoming) {
            return reply;
        }
    }
    match incoming.path.as_str() {
        "/assets/dashboard.css" => return Reply::asset("text/css; charset=utf-8", layout::CSS),
        "/assets/dashboard.js" => {
            return Reply::asset("text/javascript; charset=utf-8", layout::JS);
        }
        _ => {}
    }
    let mut conn = match dashboard.pool.get() {
        Ok(conn) => conn,
        Err(error) => return error_page(dashboard, &error),
    };
    let replied = route(dashboard, &mut conn, &incoming);
    replied.unwrap_or_else(|error| error_page(dashboard, &error))
}

/// An action must come from a page of this dashboard: a form post with its CSRF token, from
/// no other origin, and not when read-only.
fn check_action(
    dashboard: &Dashboard,
    request: &Request,
    incoming: &Incoming,
) -> Result<(), Reply> {
    if dashboard.read_only {
        return Err(Reply::text(403, "read-only: actions are refused"));
    }
    if request
        .header("Sec-Fetch-Site")
        .is_some_and(|site| site.eq_ignore_ascii_case("cross-site"))
    {
        return Err(Reply::text(403, "an action from another site is refused"));
    }
    if let (Some(origin), Some(host)) = (request.header("Origin"), request.header("Host")) {
        let own = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|rest| rest.eq_ignore_ascii_case(host));
        if !own {
            return Err(Reply::text(403, "an action from another origin is refused"));
        }
    }
    if !incoming
        .field("csrf")
        .is_some_and(|token| dashboard.access.csrf_matches(token))
    {
        return Err(Reply::text(
            403,
            "the form's CSRF token is missing or stale: reload the page and try again",
        ));
    }
    Ok(())
}

fn route(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    incoming: &Incoming,
) -> Result<Reply, Error> {
    let notice = notice(incoming);
    let notice = notice.as_deref();
    let path = incoming.path.as_str();
    if incoming.post {
        return match path {
            "/job/retry" | "/job/cancel" | "/job/skip-in-sequence" => jobs::act(conn, incoming),
            "/job/parked" => parked::act(conn, incoming),
            "/queue/pause" | "/queue/resume" | "/queue/retry-dead" => queues::act(conn, incoming),
            "/schedule/pause" | "/schedule/resume" => schedules::act(conn, incoming),
            "/lease/release" => leases::act(conn, incoming),
            _ => Ok(not_found(dashboard)),
        };
    }
    match path {
        "/" => queues::overview(dashboard, conn, notice),
        "/queue" => queues::queue_page(dashboard, conn, incoming, notice),
        "/jobs" => jobs::list(dashboard, conn, incoming),
        "/job" => jobs::job_page(dashboard, conn, incoming, notice),
        "/leases" => leases::list(dashboard, conn, notice),
        "/lease/release" => leases::confirm(dashboard, conn, incoming),
        "/schedules" => schedules::list(dashboard, conn, notice),
        "/workers" => workers::list(dashboard, conn),
        _ => Ok(not_found(dashboard)),
    }
}

/// What an action did, said on the page it leads to: fixed texts chosen by a code (a link
/// cannot put words of its own on the page).
fn notice(incoming: &Incoming) -> Option<String> {
    let n: u64 = incoming
        .field("n")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let done = incoming.field("done")?;
    if let Some(text) = parked::notice(done) {
        return Some(text.into());
    }
    Some(match done {
        "queue-paused" => "Queue paused: claims skip it until it is resumed.".into(),
        "queue-resumed" => "Queue resumed.".into(),
        "retried" => format!("Retried {n} dead job(s)."),
        "retried-one" => "Retried: the job waits again, due now.".into(),
        "not-dead" => "Not retried: the job is not dead.".into(),
        "sequence-goes-on" => "The sequence goes on: the job after this one runs.".into(),
        "not-holding" => "Nothing let go: the job holds no job of a sequence back.".into(),
        "cancelled" => "Cancelled (a running job stops when its run ends).".into(),
        "not-live" => "Not cancelled: the job had finished, or a cancel was already asked.".into(),
        "released" => "Lease released.".into(),
        "not-held" => "The lease was not held: nothing was released.".into(),
        "schedule-paused" => "Schedule paused.".into(),
        "schedule-resumed" => "Schedule resumed.".into(),
        "no-schedule" => "No such schedule.".into(),
        _ => return None,
    })
}

fn not_found(dashboard: &Dashboard) -> Reply {
    let content = html! { p { "Nothing here. " a href="/" { "Back to the queues" } } };
    Reply::html(
        404,
        layout::page(
            dashboard,
            layout::Section::Queues,
            "Not found",
            None,
            content,
        ),
    )
}

/// Bad input is the asker's (400, with what was wrong); anything else is the database's
/// (500; the message is tenure's, which never holds the URL or a password).
fn error_page(dashboard: &Dashboard, error: &Error) -> Reply {
    let status = if error.is_invalid_input() { 400 } else { 500 };
    if status == 500 {
        tracing::warn!(target: "tenure::serve", "a page failed: {error}");
    }
    let content = html! { p.error #error { (error.to_string()) } };
    let title = if status == 400 {
        "Bad request"
    } else {
        "Database error"
    };
    Reply::html(
        status,
        layout::page(dashboard, layout::Section::Queues, title, None, content),
    )
}

/// The value of a field a page or action cannot do without.
fn required<'i>(incoming: &'i Incoming, field: &'static str) -> Result<&'i str, Error> {
    incoming
        .field(field)
        .ok_or_else(|| invalid(field, "is missing"))
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidInput {
        field,
        reason: reason.into(),
    }
}

//! A synchronous web app: a signup writes the user's row and enqueues their welcome email
//! in one transaction, and a page shows the job's state. A worker in the same process
//! sends the emails.
//!
//! ```text
//! cargo run --example web_app                      # serves http://127.0.0.1:8087 until Ctrl-C
//! cargo run --example web_app -- --requests 20     # serves 20 scripted requests, then exits
//! cargo run --example web_app -- URL [--port N]    # on another database
//! ```
//!
//! Routes (`GET /` lists them): `POST /signup` with the name as the body (e.g. `curl -d ada
//! http://127.0.0.1:8087/signup`); `GET /jobs/ID`, the welcome job's state. A signup the app
//! rejects after writing the row (an empty name) rolls back the whole transaction: no user,
//! no job.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Error, Pool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let option = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let requests: Option<usize> = option("--requests").and_then(|n| n.parse().ok());
    let port: u16 = option("--port")
        .and_then(|p| p.parse().ok())
        .unwrap_or(if requests.is_some() { 0 } else { 8087 });
    let url = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_else(|| "tenure-web.db".into());

    let pool = Pool::options().max_size(12).open(&url)?;
    let mut conn = pool.get()?;
    tenure::run_migrations(&mut conn)?;
    diesel::sql_query(
        "CREATE TABLE IF NOT EXISTS example_users (id BIGINT NOT NULL PRIMARY KEY, name VARCHAR(255) NOT NULL)",
    )
    .execute(&mut *conn)?;
    if requests.is_some() {
        // The scripted run checks its own users only.
        diesel::sql_query("DELETE FROM example_users").execute(&mut *conn)?;
    }
    drop(conn);

    let sent = Arc::new(AtomicUsize::new(0));
    let sent_by_worker = sent.clone();
    let worker = Worker::builder(pool.clone())
        .queue("mail")
        .threads(2)
        .raw_handler("welcome", move |_: &JobContext, _to: &[u8]| {
            std::thread::sleep(Duration::from_millis(5)); // talk to the mail server
            sent_by_worker.fetch_add(1, Ordering::SeqCst);
            Ok::<(), JobError>(())
        })
        .start()?;

    let server = tiny_http::Server::http(("127.0.0.1", port))?;
    let address = server.server_addr().to_ip().ok_or("no address")?;
    println!("serving http://{address}");
    let client = requests.map(|n| {
        let sent = sent.clone();
        std::thread::spawn(move || scripted_client(address, n, sent))
    });
    let mut served = 0;
    for mut request in server.incoming_requests() {
        let response = handle(&pool, &mut request);
        let (status, body) = response.unwrap_or_else(|e| (500, format!("error: {e}\n")));
        request.respond(tiny_http::Response::from_string(body).with_status_code(status))?;
        served += 1;
        if requests.is_some_and(|n| served >= n) {
            break;
        }
    }
    let checked = match client {
        Some(client) => client.join().map_err(|_| "the client panicked")??,
        None => 0,
    };
    worker.shutdown(Duration::from_secs(5));
    if requests.is_some() {
        let users = pool.get().and_then(|mut conn| {
            Ok(
                diesel::sql_query("SELECT COUNT(*) AS id FROM example_users")
                    .get_result::<Id>(&mut *conn)?
                    .id,
            )
        })?;
        if users != checked as i64 {
            return Err(
                format!("{users} users for {checked} signups: the rejected one was kept").into(),
            );
        }
        println!(
            "served {served} requests: {checked} signups, each welcome email sent once; the rejected signup left no user and no job"
        );
    }
    Ok(())
}

fn handle(pool: &Pool, request: &mut tiny_http::Request) -> Result<(u16, String), BoxError> {
    let url = request.url().to_string();
    match (request.method(), url.as_str()) {
        (tiny_http::Method::Post, "/signup") => {
            let mut name = String::new();
            request.as_reader().read_to_string(&mut name)?;
            let mut conn = pool.get()?;
            let backend = pool.backend();
            // The user's row and their welcome job: both or neither.
            let signed_up = tenure::transaction(&mut conn, |conn| -> Result<_, Signup> {
                let id = next_user_id(conn, backend)?;
                diesel::sql_query(placeholders(
                    backend,
                    "INSERT INTO example_users (id, name) VALUES (?, ?)",
                ))
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(&name)
                .execute(&mut **conn)?;
                let job = jobs::enqueue(
                    conn,
                    &NewJob::new("mail", "welcome", name.clone().into_bytes()),
                )?;
                if name.trim().is_empty() {
                    // Rejected after the writes: the transaction rolls back both.
                    return Err(Signup::Rejected("a name must not be empty"));
                }
                Ok((id, job.id))
            });
            match signed_up {
                Ok((user, job)) => Ok((201, format!("user {user}, welcome job {job}\n"))),
                Err(Signup::Rejected(why)) => Ok((422, format!("{why}\n"))),
                Err(Signup::Failed(e)) => Err(e.into()),
            }
        }
        (tiny_http::Method::Get, path) if path.starts_with("/jobs/") => {
            let Ok(id) = path["/jobs/".len()..].parse::<i64>() else {
                return Ok((404, "no such job\n".into()));
            };
            match jobs::get(&mut pool.get()?, id)? {
                Some(job) => Ok((200, format!("{}\n", job.state.as_str()))),
                None => Ok((404, "no such job\n".into())),
            }
        }
        (tiny_http::Method::Get, "/") => Ok((200, ROUTES.into())),
        _ => Ok((404, format!("not found\n\n{ROUTES}"))),
    }
}

/// What `GET /` (and any unknown route) answers.
const ROUTES: &str = "\
routes:
  POST /signup    body: a name; writes the user and enqueues their welcome email (201), or
                  rejects an empty name with no user and no job (422)
  GET  /jobs/ID   the welcome job's state: waiting, running, completed, dead or cancelled
try:
  curl -d ada http://127.0.0.1:8087/signup
  curl http://127.0.0.1:8087/jobs/1
";

/// Why a signup did not happen.
enum Signup {
    Rejected(&'static str),
    Failed(Error),
}

impl From<Error> for Signup {
    fn from(e: Error) -> Self {
        Signup::Failed(e)
    }
}

impl From<diesel::result::Error> for Signup {
    fn from(e: diesel::result::Error) -> Self {
        Signup::Failed(e.into())
    }
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// The next user id (the transaction's write lock keeps two signups from taking one id on
/// SQLite; elsewhere the primary key refuses the second, and the signup fails cleanly).
fn next_user_id(
    conn: &mut tenure::PooledConnection,
    backend: tenure::Backend,
) -> Result<i64, Error> {
    let integer = if backend == tenure::Backend::Mysql {
        "SIGNED"
    } else {
        "BIGINT"
    };
    let sql =
        format!("SELECT CAST(COALESCE(MAX(id), 0) + 1 AS {integer}) AS id FROM example_users");
    Ok(diesel::sql_query(sql).get_result::<Id>(&mut **conn)?.id)
}

fn placeholders(backend: tenure::Backend, sql: &str) -> String {
    if backend != tenure::Backend::Postgres {
        return sql.to_string();
    }
    let mut n = 0;
    sql.chars()
        .map(|c| {
            if c == '?' {
                n += 1;
                format!("${n}")
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Minimal HTTP/1.0 over a socket (one request per connection): status and body.
fn http(
    address: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), BoxError> {
    let mut stream = TcpStream::connect(address)?;
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Ok((status, body))
}

/// Serves exactly `n` requests: signs up `(n - 1) / 2` users, tries one empty name
/// (rejected), waits for the worker to send the welcome emails, then reads each job's page
/// (completed); one unknown page if `n` is even. Returns how many jobs were checked.
fn scripted_client(
    address: std::net::SocketAddr,
    n: usize,
    sent: Arc<AtomicUsize>,
) -> Result<usize, BoxError> {
    let signups = n.saturating_sub(1) / 2;
    let mut jobs = Vec::new();
    for i in 0..signups {
        let (status, body) = http(address, "POST", "/signup", &format!("user-{i}"))?;
        if status != 201 {
            return Err(format!("signup answered {status}: {body}").into());
        }
        let job = body
            .rsplit(' ')
            .next()
            .and_then(|id| id.trim().parse::<i64>().ok())
            .ok_or("no job id")?;
        jobs.push(job);
    }
    let (status, _) = http(address, "POST", "/signup", "  ")?;
    if status != 422 {
        return Err(format!("an empty name answered {status}").into());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while sent.load(Ordering::SeqCst) < signups {
        if Instant::now() > deadline {
            return Err("the welcome emails were not all sent".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for job in &jobs {
        let (_, state) = http(address, "GET", &format!("/jobs/{job}"), "")?;
        if state.trim() != JobState::Completed.as_str() {
            return Err(format!("job {job} is {state:?}").into());
        }
    }
    if n % 2 == 0 {
        let (status, _) = http(address, "GET", "/nowhere", "")?;
        if status != 404 {
            return Err("an unknown page did not answer 404".into());
        }
    }
    if sent.load(Ordering::SeqCst) != signups {
        return Err("an email was sent twice, or for the rejected signup".into());
    }
    Ok(jobs.len())
}

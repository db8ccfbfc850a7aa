//! Waiting for a job's result from synchronous code: a command-line tool that enqueues and
//! waits, and a web handler that waits at most a few seconds and otherwise answers "accepted,
//! come back later" with the job's id. A worker in the same process renders; in production
//! it would as well run in another process (`tenure work`, or your own worker binary).
//!
//! ```text
//! cargo run --example wait_for_result                 # both, on tenure-wait.db
//! cargo run --example wait_for_result -- "a text"     # the CLI part, on that text
//! DATABASE_URL=postgres://root@127.0.0.1/test cargo run --example wait_for_result --features postgres
//! ```
//!
//! `jobs::wait` holds no database connection while it sleeps, and a process's waiters share
//! one read per database (every 25 ms, at once when a worker of this process finishes), so a
//! web app may let hundreds of requests wait.

use std::time::Duration;

use tenure::jobs::{self, JobResult, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Error, Pool};

/// The job: "render" a text (slowly, when asked to).
fn render(ctx: &JobContext, text: String) -> Result<(), JobError> {
    if text.starts_with("slow:") {
        std::thread::sleep(Duration::from_secs(4));
    }
    ctx.set_result(JobResult::json(&format!(
        "<h1>{}</h1>",
        text.trim_start_matches("slow:")
    ))?);
    Ok(())
}

/// What a synchronous web handler answers.
#[derive(Debug)]
enum Response {
    /// 200, with the page.
    Ok(String),
    /// 202: still rendering; the client asks again with the job's id.
    Accepted { job: i64 },
    /// 500.
    Failed(String),
}

/// A web handler: enqueue, wait up to `budget`, and answer with what there is by then.
fn handle_render(pool: &Pool, text: &str, budget: Duration) -> Response {
    let job = match NewJob::json("pages", "render", text) {
        Ok(job) => job,
        Err(e) => return Response::Failed(e.to_string()),
    };
    match jobs::enqueue_and_wait(pool, &job, budget) {
        Ok(ended) if ended.completed() => match ended.result.map(|r| r.decode::<String>()) {
            Some(Ok(page)) => Response::Ok(page),
            other => Response::Failed(format!("no page: {other:?}")),
        },
        Ok(ended) => Response::Failed(format!("job ended {}", ended.job.state.as_str())),
        Err(Error::WaitTimedOut { id, .. }) => Response::Accepted { job: id },
        Err(e) => Response::Failed(e.to_string()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "tenure-wait.db".to_string());
    let pool = Pool::open(&url)?;
    tenure::run_migrations(&mut pool.get()?)?;
    let worker = Worker::builder(pool.clone())
        .queue("pages")
        .threads(2)
        .handler("render", render)
        .start()?;

    // The command-line tool: enqueue, wait, print, exit with how the job ended.
    let text = std::env::args().nth(1).unwrap_or_else(|| "hello".into());
    let job = NewJob::json("pages", "render", &text)?;
    let ended = jobs::enqueue_and_wait(&pool, &job, Duration::from_secs(60))?;
    let page: String = ended.result.ok_or("no result")?.decode()?;
    println!(
        "cli: job {} {}: {page}",
        ended.job.id,
        ended.job.state.as_str()
    );

    // The web handler, with a 2 s budget: a quick page is served, a slow one (4 s) is accepted.
    let budget = Duration::from_secs(2);
    match handle_render(&pool, "quick", budget) {
        Response::Ok(page) => println!("web: 200 {page}"),
        Response::Accepted { job } => return Err(format!("the quick page took long: {job}").into()),
        Response::Failed(e) => return Err(format!("web: 500 {e}").into()),
    }
    let job = match handle_render(&pool, "slow:report", budget) {
        Response::Accepted { job } => job,
        Response::Ok(page) => return Err(format!("the slow page was quick: {page}").into()),
        Response::Failed(e) => return Err(format!("web: 500 {e}").into()),
    };
    println!("web: 202 accepted, job {job}");
    // The client's next request: wait for that job again, with a new budget.
    let ended = jobs::wait(&pool, job, Duration::from_secs(60))?;
    let page: String = ended.result.ok_or("no result")?.decode()?;
    println!("web: 200 {page} (job {job}, on the client's second request)");

    worker.shutdown(Duration::from_secs(10));
    Ok(())
}

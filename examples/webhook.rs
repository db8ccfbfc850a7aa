//! A job parked until a webhook answers it: the handler asks a (simulated) payment provider
//! to charge a card and to call back, parks the job with the token, and returns; the
//! provider's callback completes the job with the token and the payment's id; the program
//! waits for the job's end and prints its result.
//!
//! ```text
//! cargo run --example webhook
//! DATABASE_URL=postgres://root@127.0.0.1/test cargo run --example webhook --features postgres
//! ```
//!
//! With `tenure serve`, the provider would instead POST to `/callbacks/parked/complete` with
//! the token in the `Tenure-Park-Token` header.

use std::sync::Mutex;
use std::sync::mpsc::{Sender, channel};
use std::time::Duration;

use tenure::jobs::{self, JobResult, JobState, NewJob, ParkToken};
use tenure::worker::{JobContext, JobError, Worker};

/// The payment provider: it takes a charge and a callback, and calls back later, from
/// another thread, with the token it was given.
fn provider(requests: std::sync::mpsc::Receiver<(u64, ParkToken)>, pool: tenure::Pool) {
    for (cents, token) in requests {
        std::thread::sleep(Duration::from_millis(100)); // the card network
        let payment = JobResult::json(&serde_json::json!({"payment": "pay_42", "cents": cents}))
            .expect("a small result");
        let mut conn = pool.get().expect("a connection");
        match jobs::complete_parked(&mut conn, &token, Some(&payment)) {
            Ok(outcome) => println!("webhook: job {} answered ({outcome:?})", token.job_id()),
            Err(e) => eprintln!("webhook: refused: {e}"),
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "tenure-webhook.db".to_string());
    let pool = tenure::Pool::open(&url)?;
    tenure::run_migrations(&mut pool.get()?)?;

    let (charges, requests) = channel::<(u64, ParkToken)>();
    {
        let pool = pool.clone();
        std::thread::spawn(move || provider(requests, pool));
    }
    let charges: Mutex<Sender<(u64, ParkToken)>> = Mutex::new(charges);
    let worker = Worker::builder(pool.clone())
        .queue("payments")
        .handler("charge", move |ctx: &JobContext, cents: u64| {
            // Park first (the token is valid at once), then hand it over: a callback that
            // comes before this handler returns is kept and applied when it does.
            let token = ctx.park(Duration::from_secs(600))?;
            println!(
                "job {}: charging {cents} cents, waiting for the webhook",
                ctx.id
            );
            charges.lock().unwrap().send((cents, token))?;
            Err(JobError::parked())
        })
        .start()?;

    let id = jobs::enqueue(
        &mut pool.get()?,
        &NewJob::new("payments", "charge", b"1999".to_vec()),
    )?
    .id;
    let ended = jobs::wait(&pool, id, Duration::from_secs(60))?;
    let result = ended.result.ok_or("no result")?;
    println!(
        "job {id} is {}: {}",
        ended.job.state.as_str(),
        result.decode::<serde_json::Value>()?
    );
    assert_eq!(ended.job.state, JobState::Completed);
    let report = worker.shutdown(Duration::from_secs(10));
    println!(
        "worker: {} run(s) parked, {} completed by a run",
        report.parked, report.completed
    );
    Ok(())
}

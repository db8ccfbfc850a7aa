//! `dibs stats`: jobs per queue and state, and the running jobs' lease deadlines.

use dibs::Pool;
use dibs::jobs;
use serde_json::json;

use crate::Outcome;
use crate::output::{Out, age, table};

pub fn stats(pool: &Pool, out: &Out) -> Outcome {
    let stats = jobs::stats(&mut pool.get()?)?;
    let queues: Vec<_> = stats
        .queues
        .iter()
        .map(|q| {
            json!({"queue": q.queue, "waiting": q.waiting, "running": q.running,
                   "completed": q.completed, "dead": q.dead, "cancelled": q.cancelled,
                   "paused": q.paused, "oldest_waiting_seconds": q.oldest_waiting.num_milliseconds() as f64 / 1000.0})
        })
        .collect();
    let running: Vec<_> = stats
        .running
        .iter()
        .map(|r| {
            json!({"id": r.id, "queue": r.queue, "kind": r.kind, "attempt": r.attempt,
                        "claim_expires_at": r.claim_expires_at})
        })
        .collect();
    out.print(
        json!({"now": stats.now, "queues": queues, "running": running}),
        || {
            let mut text = table(
                &[
                    "queue",
                    "waiting",
                    "running",
                    "completed",
                    "dead",
                    "cancelled",
                    "paused",
                    "oldest waiting",
                ],
                stats.queues.iter().map(|q| {
                    vec![
                        q.queue.clone(),
                        q.waiting.to_string(),
                        q.running.to_string(),
                        q.completed.to_string(),
                        q.dead.to_string(),
                        q.cancelled.to_string(),
                        if q.paused {
                            "yes".into()
                        } else {
                            String::new()
                        },
                        if q.waiting > 0 {
                            age(q.oldest_waiting)
                        } else {
                            String::new()
                        },
                    ]
                }),
            );
            if !stats.running.is_empty() {
                text.push_str("\nrunning jobs (claim expires in):\n");
                text.push_str(&table(
                    &["id", "queue", "kind", "attempt", "expires in"],
                    stats.running.iter().map(|r| {
                        vec![
                            r.id.to_string(),
                            r.queue.clone(),
                            r.kind.clone(),
                            r.attempt.to_string(),
                            r.claim_expires_at
                                .map_or(String::new(), |at| age(at - stats.now)),
                        ]
                    }),
                ));
            }
            text
        },
    )
}

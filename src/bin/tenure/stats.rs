//! `tenure stats`: jobs per queue and state (`blocked`: waiting for their dependencies;
//! `parked`: waiting for an outside answer), and
//! the running jobs' lease deadlines.

use serde_json::json;
use tenure::Pool;
use tenure::jobs;

use crate::Outcome;
use crate::output::{Out, age, table};

pub fn stats(pool: &Pool, out: &Out) -> Outcome {
    let mut conn = pool.get()?;
    let stats = jobs::stats(&mut conn)?;
    let queue_limits: std::collections::HashMap<String, u32> =
        jobs::queue_limits(&mut conn)?.into_iter().collect();
    let keys = jobs::key_states(&mut conn, 100)?;
    let queues: Vec<_> = stats
        .queues
        .iter()
        .map(|q| {
            json!({"queue": q.queue, "blocked": q.blocked, "waiting": q.waiting, "running": q.running,
                   "parked": q.parked, "completed": q.completed, "dead": q.dead, "cancelled": q.cancelled,
                   "paused": q.paused, "max_running": queue_limits.get(&q.queue),
                   "oldest_waiting_seconds": q.oldest_waiting.num_milliseconds() as f64 / 1000.0})
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
    let key_rows: Vec<_> = keys
        .iter()
        .map(|k| {
            json!({"key": k.key, "running": k.running, "max_running": k.max_running,
                   "saturated": k.saturated(), "throttled_until": k.throttled_until})
        })
        .collect();
    out.print(
        json!({"now": stats.now, "queues": queues, "running": running, "limit_keys": key_rows}),
        || {
            let mut text = table(
                &[
                    "queue",
                    "blocked",
                    "waiting",
                    "running",
                    "parked",
                    "completed",
                    "dead",
                    "cancelled",
                    "paused",
                    "limit",
                    "oldest waiting",
                ],
                stats.queues.iter().map(|q| {
                    vec![
                        q.queue.clone(),
                        q.blocked.to_string(),
                        q.waiting.to_string(),
                        q.running.to_string(),
                        q.parked.to_string(),
                        q.completed.to_string(),
                        q.dead.to_string(),
                        q.cancelled.to_string(),
                        if q.paused {
                            "yes".into()
                        } else {
                            String::new()
                        },
                        queue_limits
                            .get(&q.queue)
                            .map_or(String::new(), |max| format!("{max} running")),
                        if q.waiting > 0 {
                            age(q.oldest_waiting)
                        } else {
                            String::new()
                        },
                    ]
                }),
            );
            if !keys.is_empty() {
                text.push_str("\nlimit keys in use:\n");
                text.push_str(&table(
                    &["key", "running", "cap", "state", "frees in"],
                    keys.iter().map(|k| {
                        let throttled = k.throttled_until.filter(|at| *at > stats.now);
                        let state = match (k.saturated(), throttled.is_some()) {
                            (true, true) => "saturated, throttled",
                            (true, false) => "saturated",
                            (false, true) => "throttled",
                            (false, false) => "",
                        };
                        vec![
                            k.key.clone(),
                            k.running.to_string(),
                            k.max_running.map_or(String::new(), |m| m.to_string()),
                            state.to_string(),
                            throttled.map_or(String::new(), |at| age(at - stats.now)),
                        ]
                    }),
                ));
            }
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

//! `tenure queues`: pause and resume a queue (its waiting jobs stay; no worker claims them
//! while it is paused; running jobs finish).

use clap::Subcommand;
use serde_json::json;
use tenure::Pool;
use tenure::jobs;

use crate::output::Out;
use crate::{Failure, Outcome};

#[derive(Subcommand)]
pub enum QueuesCommand {
    /// Stop workers claiming the queue's jobs (enqueues go on; running jobs finish).
    Pause { queue: String },
    /// Let workers claim the queue's jobs again.
    Resume { queue: String },
}

pub fn run(
    open: impl FnOnce() -> Result<Pool, Failure>,
    command: QueuesCommand,
    out: &Out,
) -> Outcome {
    let (queue, paused) = match &command {
        QueuesCommand::Pause { queue } => (queue, true),
        QueuesCommand::Resume { queue } => (queue, false),
    };
    let mut conn = open()?.get()?;
    if paused {
        jobs::pause(&mut conn, queue)?;
    } else {
        jobs::resume(&mut conn, queue)?;
    }
    out.print(json!({"queue": queue, "paused": paused}), || {
        if paused {
            format!("queue {queue} paused: no worker claims its jobs until `tenure queues resume {queue}`")
        } else {
            format!("queue {queue} resumed")
        }
    })
}

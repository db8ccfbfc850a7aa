//! Wake-ups: an enqueue wakes the idle workers of its queues in this process at once, on
//! every backend, and on PostgreSQL those of other processes by NOTIFY ([`notify`],
//! [`notify_committed`]). The queue layer calls [`wake`]; workers [`register`] themselves.
//! Neither knows the other.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use diesel::prelude::*;
use diesel::sql_types::Text;

use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::{Error, Result, TenureConnection};

/// Something that wants to hear of new jobs: a running worker.
pub(crate) trait Waker: Send + Sync {
    /// A job of `queue` may be due now. A wake-up for a job not committed yet only costs an
    /// empty claim.
    fn wake(&self, queue: &str);
}

static WAKERS: Mutex<Vec<Weak<dyn Waker>>> = Mutex::new(Vec::new());

/// Adds a waker for as long as it lives.
pub(crate) fn register(waker: Weak<dyn Waker>) {
    let mut wakers = WAKERS.lock().unwrap_or_else(PoisonError::into_inner);
    wakers.retain(|w| w.strong_count() > 0);
    wakers.push(waker);
}

/// Wakes this process's wakers for `queues` (called after an enqueue).
pub(crate) fn wake<'q>(queues: impl IntoIterator<Item = &'q str>) {
    let wakers: Vec<Arc<dyn Waker>> = {
        let wakers = WAKERS.lock().unwrap_or_else(PoisonError::into_inner);
        wakers.iter().filter_map(Weak::upgrade).collect()
    };
    if wakers.is_empty() {
        return;
    }
    let queues: Vec<&str> = queues.into_iter().collect();
    for waker in wakers {
        for queue in &queues {
            waker.wake(queue);
        }
    }
}

/// Wakes idle workers of `queues` in other processes where the backend can: PostgreSQL's
/// NOTIFY, delivered when the connection's transaction commits. Inside a caller's
/// transaction, so that a rolled-back enqueue wakes nobody.
pub(crate) fn notify<'q, C: TenureConnection>(
    conn: &mut C,
    queues: impl IntoIterator<Item = &'q str>,
) -> Result<()> {
    send(conn, queues, false)
}

fn send<'q, C: TenureConnection>(
    conn: &mut C,
    queues: impl IntoIterator<Item = &'q str>,
    unflushed: bool,
) -> Result<()> {
    let queues: HashSet<&str> = queues.into_iter().collect();
    dispatch!(conn, c => {
        let syntax = c.syntax();
        let sql = if unflushed { syntax.notify_queue_unflushed } else { syntax.notify_queue };
        if let Some(sql) = sql {
            for queue in queues {
                statement(c.syntax().render(sql)).bind::<Text, _>(queue).execute(c)?;
            }
        }
        Ok::<(), Error>(())
    })
}

/// [`notify`] after the enqueue committed, in a transaction of its own. A NOTIFY makes its
/// transaction take PostgreSQL's cluster-wide notify lock at commit and hold it until the
/// commit is flushed: in the inserting transaction every enqueuer's commit would wait for
/// the one before it (measured: 16 producers at 0.37-0.44 of a plain insert's rate). The
/// notifying transaction commits with `synchronous_commit` off (for it alone), so it holds
/// the lock only for a moment and adds no flush of its own; a crash can lose the wake-up,
/// not the job. Its failure is logged and not returned: the jobs are in (a caller retrying
/// would double them), and idle workers still find them at their next poll.
pub(crate) fn notify_committed<'q, C: TenureConnection>(
    conn: &mut C,
    queues: impl IntoIterator<Item = &'q str>,
) {
    if conn.backend() != crate::Backend::Postgres {
        return;
    }
    if let Err(e) = send(conn, queues, true) {
        tracing::warn!(error = %e, "the jobs are enqueued, but waking other processes' workers failed");
    }
}

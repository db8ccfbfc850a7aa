//! The queue core: what a job is and what a call reports ([`model`], [`new_job`]), enqueueing
//! one job ([`enqueue`](mod@enqueue)), many at once ([`bulk`], by COPY on PostgreSQL:
//! `copy_in`) and typed jobs ([`typed`]); claiming due jobs ([`claim`](mod@claim)),
//! finishing claims ([`finish`]: complete, fail, renew, give back, snooze), and rescue
//! ([`rescue`](mod@rescue)): returning the claims that lapsed, or whose worker died, to the
//! queue; waiting for a job to end ([`wait`](mod@wait)). Also the bounds every call of the
//! queue checks.

pub(crate) mod bulk;
pub(crate) mod claim;
#[cfg(feature = "postgres")]
mod copy_in;
pub(crate) mod enqueue;
pub(crate) mod errors;
pub(crate) mod finish;
pub(crate) mod model;
pub(crate) mod new_job;
pub(crate) mod rescue;
pub(crate) mod typed;
pub(crate) mod wait;

use crate::rows::IdRow;
use crate::{Error, Result};

pub use bulk::enqueue_many;
pub(crate) use claim::claim_kinds_throttled;
pub use claim::{claim, claim_kinds};
pub use enqueue::enqueue;
pub use finish::{complete, fail, give_back, renew, snooze};
pub(crate) use finish::{complete_with_results, snooze_noting_death};
pub use model::{Backoff, ClaimedJob, Job, JobClaim, JobState, Outcome, Rescued, Retry};
pub use new_job::{DedupOver, Due, Enqueued, NewJob, OnDuplicate};
pub use rescue::rescue;
pub(crate) use rescue::{record_start, rescue_dead, rescue_lapsed};
pub use typed::{JobArgs, enqueue_job, enqueue_jobs};
pub use wait::{Ended, POLL_INTERVAL, enqueue_and_wait, wait};

/// How many errors a job's history keeps (the newest).
pub const MAX_ERROR_HISTORY: usize = 20;

/// The largest payload, in bytes (MariaDB's default `max_allowed_packet` is 16 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 8 * 1024 * 1024;
/// A job charged this many lapses (its worker died or stalled holding it each time) is dead:
/// a job that takes its worker down cannot loop forever. A lapsed claim uses no attempt, since
/// the worker may have died before the run began. A job's first lapse is always charged;
/// later ones only for a run that began (a worker records the start of a job with lapses,
/// and runs one such job at a time), so jobs claimed ahead of a crashing one never die of
/// its crashes.
pub const MAX_LAPSES: u32 = 5;
/// A job's runs may be snoozed ([`snooze`]) this many times without using an attempt; every
/// further snooze uses one (and a job out of attempts is then dead), so a job that snoozes
/// forever cannot stay in the queue forever.
pub const MAX_FREE_SNOOZES: u32 = 100;
/// The most kinds one [`claim_kinds`] takes.
pub const MAX_KINDS: usize = 100;
/// The most attempts a job may have.
pub const MAX_ATTEMPTS: u32 = 1000;
/// The most jobs one call handles: one claim or rescue, one list of claims to finish, one
/// prune or listing.
pub const MAX_BATCH: usize = 1000;
/// Longer error messages are cut to this many bytes (at a character boundary).
pub const MAX_ERROR_BYTES: usize = 4096;

pub(crate) fn ids_of(rows: Vec<IdRow>) -> Vec<i64> {
    rows.into_iter().map(|row| row.id).collect()
}

/// How many jobs one call may handle (claim, rescue, prune, read): 1 to [`MAX_BATCH`].
pub(crate) fn check_count(count: usize) -> Result<i64> {
    if count == 0 || count > MAX_BATCH {
        return Err(Error::invalid(
            "limit",
            format!("{count} is not between 1 and {MAX_BATCH}"),
        ));
    }
    Ok(count as i64)
}

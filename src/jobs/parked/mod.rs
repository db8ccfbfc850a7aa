//! Parked jobs (`tenure_parked`): a job waits, holding no claim, until something outside
//! answers it with its token or its deadline passes.
//!
//! A job is parked by its run ([`JobContext::park`](crate::worker::JobContext::park), then
//! [`JobError::parked`](crate::worker::JobError::parked)) or at enqueue ([`enqueue_parked`]).
//! Its token answers it once: [`complete_parked`] (completed with a result, its dependents
//! released as by any completion), [`fail_parked`] (a failed run: retried with backoff while
//! attempts remain, else dead) or [`resume_parked`] (waiting again, due at once, its next run
//! reading the value given with [`JobContext::resume_value`](crate::worker::JobContext::resume_value)).
//! Past its deadline (database clock) a worker's maintenance fails it as [`fail_parked`]
//! would ([`expire_parked`]).
//!
//! Every transition locks the job's row first, then reads or writes its `tenure_parked` row:
//! an answer, the deadline's expiry, a cancel and the worker's record of the parking run are
//! serialised by that lock, so of two that race exactly one applies.
//!
//! **Once `ctx.park` returned a token, the job waits for it.** The token exists before the
//! run ends; an answer then is kept in the park's row as pending ([`ParkedOutcome::Accepted`])
//! and applied, once, in the transaction that parks the job. The job is parked when the
//! handler returns `JobError::parked()`, even past the shutdown's grace or the kind's timeout
//! (parking ends the run as a give-back would), and when the run's claim is taken back
//! instead (the worker died or stalled between `ctx.park` and recording the park: the rescue
//! parks the job rather than requeueing it). A run parks once: a second `ctx.park` is
//! [`crate::Error::InvalidInput`] and the first token stays the job's.
//!
//! **Unless the handler ends its run another way.** If it returns anything but
//! `JobError::parked()` after `ctx.park` (a result, an error, a panic), the run's end wins:
//! the token is refused after ([`ParkRefusal::NotParked`], or [`ParkRefusal::Used`] if it
//! was answered), and a pending answer is never applied and never read (not as a
//! [`JobContext::resume_value`](crate::worker::JobContext::resume_value) either). The caller
//! was told `Accepted`, not `Applied`; [`crate::jobs::wait`] tells it how the job ended.

mod answer;
mod expire;
mod inspect;
mod park;
mod token;

use std::fmt;

pub(crate) use answer::resume_value;
pub use answer::{complete_parked, fail_parked, resume_parked};
pub use expire::expire_parked;
pub use inspect::{ParkRecord, park_record};
pub use park::{EnqueuedParked, enqueue_parked};
pub(crate) use park::{park_in_run, park_rescued_runs, record_parked_run};
pub use token::ParkToken;

/// Why a park token was refused ([`crate::Error::ParkTokenRefused`]). Nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkRefusal {
    /// Not a token of any park: malformed, guessed, of a job that has none, or of an
    /// earlier park of a job that parked again (a job keeps its last park only). A wrong
    /// token for a real job gets this too, so a guess learns nothing.
    Invalid,
    /// The token was used already: a second answer.
    Used,
    /// The token is right but its job is no longer parked: its deadline passed, it was
    /// cancelled, or the run that parked it ended another way.
    NotParked,
}

impl fmt::Display for ParkRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ParkRefusal::Invalid => "not the token of a parked job",
            ParkRefusal::Used => "the token was used already",
            ParkRefusal::NotParked => "its job is no longer parked",
        })
    }
}

/// What an accepted answer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkedOutcome {
    /// Applied now: the job is completed, failed (waiting for its retry, or dead) or
    /// waiting again.
    Applied,
    /// The run that parked the job has not returned yet: the answer is kept and applied when
    /// it returns `JobError::parked()` (see the module docs).
    Accepted,
}

/// The park row's `answer` values.
pub(crate) mod answers {
    pub const COMPLETE: &str = "complete";
    pub const FAIL: &str = "fail";
    pub const RESUME: &str = "resume";
    /// The deadline passed: the job failed.
    pub const EXPIRED: &str = "expired";
    /// The job left its park another way (cancelled, the run ended otherwise).
    pub const DROPPED: &str = "dropped";

    /// An answer that came while the run that parked still held its claim: kept under this
    /// name until the job is parked, when it is applied and takes its own name. A pending
    /// answer of a run that ended another way is never applied, nor read as a resume.
    pub fn pending(answer: &str) -> &'static str {
        match answer {
            COMPLETE => "pending-complete",
            RESUME => "pending-resume",
            _ => "pending-fail",
        }
    }

    /// The answer a pending one stands for; `None`: not a pending answer.
    pub fn of_pending(stored: &str) -> Option<&'static str> {
        match stored {
            "pending-complete" => Some(COMPLETE),
            "pending-resume" => Some(RESUME),
            "pending-fail" => Some(FAIL),
            _ => None,
        }
    }
}

//! Maintenance: moving jobs that waited too long to the front ([`aging`]), keeping the tables to size ([`retention`]: pruning finished jobs by policy),
//! an operator's calls ([`admin`]: cancel, run the dead again), reading the queue
//! ([`inspect`]: a job, a list, a job's failed runs, the figures per queue), and what runs
//! printed ([`outputs`](mod@outputs)), and reclaiming the claims' dead entries ([`ring`]:
//! PostgreSQL's ready ring), and finished jobs' space by whole slots ([`slots`]).

pub(crate) mod admin;
pub(crate) mod aging;
pub(crate) mod inspect;
pub(crate) mod outputs;
pub(crate) mod retention;
pub(crate) mod ring;
pub(crate) mod slots;

pub use admin::{cancel, retry_dead, retry_dead_of_kind, skip_in_sequence};
pub use aging::{AGED_PRIORITY, age_priorities};
pub use inspect::{FailedRun, JobFilter, QueueStats, RunningJob, Stats, get, history, list, stats};
pub use outputs::{MAX_OUTPUT_BYTES, RunOutput, outputs, record_output};
pub use retention::{Finished, Retention, prune};
pub use ring::rotate_ready;
pub use slots::{ReclaimedSlots, reclaim_job_slots, rotate_job_slots};

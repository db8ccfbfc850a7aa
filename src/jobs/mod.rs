//! The job queue: enqueue, claim, and finish jobs (`tenure_jobs`).
//!
//! Six subsystems, one folder each (see `docs/layout.md`): the queue core (`queue`:
//! enqueue, the job model, claim, finish, rescue), flow control (`flow`: limits, admission,
//! pauses, queue depth), workflows and results (`workflows`), parked jobs (`parked`: a
//! token that answers a job once), maintenance (`maintenance`: retention, an operator's
//! calls, inspection), and the worker registry (`registry`).
//! Applications use the names re-exported here.
//!
//! A job is *waiting* (due now or later, retries included), *running* (claimed by a worker
//! for a limited time, under a fresh random claim token), *parked* (until something outside
//! answers it with its token, or its deadline passes), *completed* or *dead* (failed for
//! good). Delayed jobs are plain waiting rows with a future due time: there is no promotion
//! pass.
//!
//! | operation | connection | notes |
//! |---|---|---|
//! | [`enqueue`], [`enqueue_many`] | any, joins the caller's transaction | a rolled-back transaction leaves no job |
//! | [`claim`], [`claim_kinds`] | bare | atomic: no job is ever held by two claimers |
//! | [`complete`], [`fail`], [`renew`], [`give_back`], [`snooze`] | any; inside the caller's transaction they commit with it | fenced by the claim token, one [`Outcome`] per job |
//! | [`rescue`] | bare | returns stalled jobs (claim lapsed, or its worker died) to the queue, or marks them dead |
//! | [`complete_parked`], [`fail_parked`], [`resume_parked`] | any, joins the caller's transaction | answer a *parked* job by its [`ParkToken`], once |
//! | [`expire_parked`] | any | fails parked jobs past their deadline (workers call it) |
//! | [`run_step`] | any (its own transaction, or a savepoint of the caller's) | fenced by the claim token; the step's result commits with its writes |
//! | [`get`] | any | a job's state |
//! | [`wait`], [`enqueue_and_wait`], [`wait_workflow`] | a [`Pool`](crate::Pool), none held while asleep | blocks until the job (every job of the workflow) ends or a timeout |
//!
//! Handlers run at least once. Exactly once there is for the handler's own writes and
//! [`complete`] in one transaction ([`crate::transaction`]), which commits only if the claim
//! is still this worker's, and for a step's writes with its stored result ([`run_step`],
//! [`crate::worker::JobContext::step`]), under the same fence: a retry reads the result back
//! instead of running the step again.
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! use std::time::Duration;
//! use tenure::jobs::{self, NewJob, Outcome};
//! let mut conn = tenure::AnyConnection::connect(":memory:")?;
//! tenure::run_migrations(&mut conn)?;
//!
//! let id = jobs::enqueue(&mut conn, &NewJob::new("mail", "welcome", b"ada@example.com".to_vec()))?.id;
//! let claimed = jobs::claim(&mut conn, "mail", 10, Duration::from_secs(60))?;
//! assert_eq!(claimed[0].id, id);
//! assert_eq!(jobs::complete(&mut conn, &[claimed[0].claim()])?, vec![Outcome::Done]);
//! # Ok(()) }
//! ```

mod flow;
mod maintenance;
mod parked;
mod queue;
pub(crate) mod registry;
mod workflows;

// The queue core: what a job is, enqueueing it, claiming it, finishing it, rescuing it.
pub use queue::{
    Backoff, ClaimedJob, DedupOver, Due, Ended, Enqueued, Job, JobArgs, JobClaim, JobState, NewJob,
    OnDuplicate, Outcome, POLL_INTERVAL, Rescued, Retry, claim, claim_kinds, complete, enqueue,
    enqueue_and_wait, enqueue_job, enqueue_jobs, enqueue_many, fail, give_back, renew, rescue,
    snooze, wait,
};
// The queue core's bounds on what a call accepts.
pub use queue::{
    MAX_ATTEMPTS, MAX_BATCH, MAX_ERROR_BYTES, MAX_ERROR_HISTORY, MAX_FREE_SNOOZES, MAX_KINDS,
    MAX_LAPSES, MAX_PAYLOAD_BYTES,
};
pub(crate) use queue::{
    claim_kinds_throttled, complete_with_results, record_start, rescue_dead, rescue_lapsed,
    snooze_noting_death,
};

// Flow control: limits a job carries, queue-wide limits, pauses, sequences, fair shares, a
// queue's depth.
pub use flow::{
    KeyState, Limit, MAX_DEPTH_BOUND, MAX_FAIR_WEIGHT, MAX_LIMIT, MAX_LIMITS, QueueCounts,
    QueueDepth, Rate, SequenceFailure, is_paused, key_states, limit_queue, limits_of, pause,
    queue_counts, queue_depth, queue_limits, resume, set_fair_weight,
};

// Workflows and results: dependencies, workflows (and batches with callbacks), results and
// progress.
pub use workflows::{
    DependencyResult, EnqueuedWorkflow, JobResult, MAX_DEPENDENCIES, MAX_PROGRESS_MESSAGE_BYTES,
    MAX_RESULT_BYTES, RunWhen, StateCounts, Step, Workflow, WorkflowJob, WorkflowStatus,
    cancel_workflow, complete_with_result, dependency_results, dependency_results_after,
    enqueue_workflow, progress, record_progress, result, wait_workflow, workflow_jobs,
    workflow_status,
};
// Durable steps: a step's result committed with its writes, read back on a retry.
pub(crate) use workflows::steps::{decode_step, run_unfenced_step};
pub use workflows::{JobStep, StepError, run_step, steps};

// Parked jobs: parked by a run or at enqueue, answered once by their token, or failed at
// their deadline.
pub use parked::{
    EnqueuedParked, ParkRecord, ParkRefusal, ParkToken, ParkedOutcome, complete_parked,
    enqueue_parked, expire_parked, fail_parked, park_record, resume_parked,
};
pub(crate) use parked::{park_in_run, record_parked_run, resume_value};

// Maintenance: priority aging, retention, an operator's calls, reading the queue, runs' outputs.
pub(crate) use maintenance::aging::age_batch;
pub(crate) use maintenance::retention::prune_after;
pub use maintenance::{
    AGED_PRIORITY, FailedRun, Finished, JobFilter, MAX_OUTPUT_BYTES, QueueStats, ReclaimedSlots,
    Retention, RunOutput, RunningJob, Stats, age_priorities, cancel, get, history, list, outputs,
    prune, reclaim_job_slots, record_output, retry_dead, retry_dead_of_kind, rotate_job_slots,
    rotate_ready, skip_in_sequence, stats,
};

//! Workflows and results: jobs that wait for other jobs ([`dependencies`]: a blocked job's
//! counters and its release by the transaction that finishes the last of them), workflows of
//! jobs enqueued together, and batches (workflows with callback jobs) ([`workflow`]), and what
//! runs leave for others to read: results and progress ([`results`]), and a job's completed
//! steps, kept across its retries ([`steps`]); waiting for a workflow to end
//! ([`wait`](mod@wait)).

pub(crate) mod dependencies;
pub(crate) mod results;
pub(crate) mod sequence_edges;
pub(crate) mod steps;
pub(crate) mod wait;
pub(crate) mod workflow;

pub use dependencies::{MAX_DEPENDENCIES, RunWhen};
pub use results::{
    DependencyResult, JobResult, MAX_PROGRESS_MESSAGE_BYTES, MAX_RESULT_BYTES,
    complete_with_result, dependency_results, dependency_results_after, progress, record_progress,
    result,
};
pub use steps::{JobStep, StepError, run_step, steps};
pub use wait::wait_workflow;
pub use workflow::{
    EnqueuedWorkflow, StateCounts, Step, Workflow, WorkflowJob, WorkflowStatus, cancel_workflow,
    enqueue_workflow, workflow_jobs, workflow_status,
};

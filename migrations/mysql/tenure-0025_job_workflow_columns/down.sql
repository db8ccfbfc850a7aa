ALTER TABLE tenure_jobs
    DROP INDEX tenure_jobs_workflow,
    DROP COLUMN progress_message,
    DROP COLUMN progress,
    DROP COLUMN dependents,
    DROP COLUMN stripes_pending,
    DROP COLUMN run_when,
    DROP COLUMN workflow_id;

-- Workflows: jobs that wait for other jobs, batches with callbacks, results and progress.
-- workflow_id: the workflow (tenure_workflows) a job belongs to, if any.
-- run_when: for a job with dependencies, when it runs: 'all_completed', 'all_finished' or
-- 'any_failed' (crate::jobs::RunWhen). It is 'blocked' until then.
-- stripes_pending: its dependency stripes (tenure_dependency_stripes) with dependencies still
-- pending; the job is decided when it reaches 0.
-- dependents: how many jobs were enqueued depending on this one: finishing it looks for them
-- only if any (and every such enqueue writes the row, so a finish in an older REPEATABLE READ
-- snapshot fails with a serialization error rather than miss the new dependent).
-- progress, progress_message: what a running job last reported.
ALTER TABLE tenure_jobs ADD COLUMN workflow_id INTEGER;
ALTER TABLE tenure_jobs ADD COLUMN run_when TEXT;
ALTER TABLE tenure_jobs ADD COLUMN stripes_pending INTEGER;
ALTER TABLE tenure_jobs ADD COLUMN dependents INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tenure_jobs ADD COLUMN progress REAL;
ALTER TABLE tenure_jobs ADD COLUMN progress_message TEXT;
CREATE INDEX tenure_jobs_workflow ON tenure_jobs (workflow_id, state) WHERE workflow_id IS NOT NULL;
-- A workflow (or batch): its name and its callback jobs.
CREATE TABLE tenure_workflows (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    name       TEXT NOT NULL,
    created_at TEXT NOT NULL,
    on_success INTEGER,
    on_failure INTEGER,
    on_finish  INTEGER
);
-- job_id waits for depends_on. stripe: the stripe of job_id the edge counts in; counted: 1
-- once depends_on finished and the stripe was counted down (0 again if a dead depends_on is
-- retried while job_id is blocked). run_when: job_id's (it never changes), so a finish reads
-- everything it decides on from rows it locks.
CREATE TABLE tenure_job_dependencies (
    job_id         INTEGER NOT NULL,
    depends_on     INTEGER NOT NULL,
    stripe         INTEGER NOT NULL,
    counted        INTEGER NOT NULL DEFAULT 0,
    run_when       TEXT NOT NULL,
    PRIMARY KEY (job_id, depends_on)
);
CREATE INDEX tenure_job_dependencies_depends_on ON tenure_job_dependencies (depends_on);
-- A blocked job's dependencies still pending, spread over stripes, so that finishing its
-- dependencies at once does not serialize on one row: a finish decrements its stripe, and only
-- the finish that empties a stripe touches the job's row (stripes_pending).
CREATE TABLE tenure_dependency_stripes (
    job_id  INTEGER NOT NULL,
    stripe  INTEGER NOT NULL,
    pending INTEGER NOT NULL,
    PRIMARY KEY (job_id, stripe)
);
-- The result a completed job's handler returned; deleted with the job.
CREATE TABLE tenure_job_results (
    job_id INTEGER PRIMARY KEY,
    format TEXT NOT NULL,
    body   BLOB NOT NULL
);

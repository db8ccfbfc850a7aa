-- A job's completed steps (`ctx.step`): each step's result, written in the transaction of the
-- step's own writes while the run held its claim; a retry reads it instead of running the
-- step again. Kept across retries and revivals, deleted with the job.
CREATE TABLE tenure_steps (
    job_id     bigint           NOT NULL,
    name       text COLLATE "C" NOT NULL,
    result     bytea            NOT NULL,
    created_at timestamptz      NOT NULL,
    PRIMARY KEY (job_id, name)
);

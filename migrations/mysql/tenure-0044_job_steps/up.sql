-- A job's completed steps (`ctx.step`): each step's result, written in the transaction of the
-- step's own writes while the run held its claim; a retry reads it instead of running the
-- step again. Kept across retries and revivals, deleted with the job.
CREATE TABLE IF NOT EXISTS tenure_steps (
    job_id     BIGINT         NOT NULL,
    name       VARBINARY(255) NOT NULL,
    result     MEDIUMBLOB     NOT NULL,
    created_at DATETIME(6)    NOT NULL,
    PRIMARY KEY (job_id, name)
) ENGINE = InnoDB;

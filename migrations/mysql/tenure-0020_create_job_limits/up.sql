-- Flow control. A job's limits, one row per key: a concurrency cap (max_running: at most so
-- many running jobs with this key) and/or a rate (at most rate_max starts per rate_period_us,
-- in any window of that length). tenure_jobs.limit_key and limit_max stay and name the job's
-- first limit, so "limit_key IS NOT NULL" says a job has rows here: a claim reads them only
-- then. Deleted with the job.
CREATE TABLE IF NOT EXISTS tenure_job_limits (
    job_id         BIGINT         NOT NULL,
    limit_key      VARBINARY(255) NOT NULL,
    max_running    INT            NULL,
    rate_max       INT            NULL,
    rate_period_us BIGINT         NULL,
    PRIMARY KEY (job_id, limit_key)
) ENGINE = InnoDB;

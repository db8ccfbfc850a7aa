-- The starts of rate-limited keys (a start's instant is its job's claimed_at), the newest
-- 10,000 or more per key: a claim counts them in its window.
CREATE TABLE IF NOT EXISTS tenure_limit_starts (
    limit_key  VARBINARY(255) NOT NULL,
    started_at DATETIME(6)    NOT NULL,
    job_id     BIGINT         NOT NULL,
    PRIMARY KEY (limit_key, started_at, job_id)
) ENGINE = InnoDB;

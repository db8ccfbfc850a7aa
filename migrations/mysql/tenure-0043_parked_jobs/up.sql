-- Parked jobs (state parked in tenure_jobs): a side table, one row per job, its last park.
-- A table of its own rather than columns on tenure_jobs: a park is rare beside the millions
-- of jobs that never park, its columns (a token hash, a deadline, an answer and its value)
-- mean nothing to other jobs, and the claim and finish statements read tenure_jobs rows
-- that stay as narrow as they were. Every write here is made holding the job row's lock.
-- token_hash: SHA-256 of the token's secret (the secret itself is never stored).
-- claim_token: the run that parked it (NULL: parked at enqueue); answer: complete, fail
-- or resume once the token was used (its value, error and time beside it), NULL while it
-- may be used. The expiry pass reads open rows by deadline (tenure_parked_open).
-- No partial indexes here: answered_at leads the index, and open rows are its NULLs.
CREATE TABLE IF NOT EXISTS tenure_parked (
    job_id              BIGINT      NOT NULL PRIMARY KEY,
    token_hash          BLOB        NOT NULL,
    claim_token         BINARY(16)  NULL,
    parked_at           DATETIME(6) NOT NULL,
    deadline            DATETIME(6) NOT NULL,
    backoff_base_micros BIGINT      NOT NULL,
    backoff_max_micros  BIGINT      NOT NULL,
    answer              VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NULL,
    value_format        VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NULL,
    value_body          MEDIUMBLOB  NULL,
    answer_error        TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    answered_at         DATETIME(6) NULL,
    INDEX tenure_parked_open (answered_at, deadline)
) ENGINE = InnoDB;

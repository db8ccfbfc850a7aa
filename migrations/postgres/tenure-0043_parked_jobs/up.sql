-- Parked jobs (state parked in tenure_jobs): a side table, one row per job, its last park.
-- A table of its own rather than columns on tenure_jobs: a park is rare beside the millions
-- of jobs that never park, its columns (a token hash, a deadline, an answer and its value)
-- mean nothing to other jobs, and the claim and finish statements read tenure_jobs rows
-- that stay as narrow as they were. Every write here is made holding the job row's lock.
-- token_hash: SHA-256 of the token's secret (the secret itself is never stored).
-- claim_token: the run that parked it (NULL: parked at enqueue); answer: complete, fail
-- or resume once the token was used (its value, error and time beside it), NULL while it
-- may be used. The expiry pass reads open rows by deadline (tenure_parked_open).
CREATE TABLE tenure_parked (
    job_id              bigint      PRIMARY KEY,
    token_hash          bytea       NOT NULL,
    claim_token         uuid,
    parked_at           timestamptz NOT NULL,
    deadline            timestamptz NOT NULL,
    backoff_base_micros bigint      NOT NULL,
    backoff_max_micros  bigint      NOT NULL,
    answer              text,
    value_format        text,
    value_body          bytea,
    answer_error        text,
    answered_at         timestamptz
);
CREATE INDEX tenure_parked_open ON tenure_parked (deadline) WHERE answered_at IS NULL;

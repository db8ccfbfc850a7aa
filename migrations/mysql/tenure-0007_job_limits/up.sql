-- Concurrency limits: at most limit_max running jobs per limit_key (one DDL statement).
ALTER TABLE tenure_jobs
    ADD COLUMN IF NOT EXISTS limit_key VARBINARY(255) NULL,
    ADD COLUMN IF NOT EXISTS limit_max INT NULL,
    ADD INDEX IF NOT EXISTS tenure_jobs_limit (limit_key, state);

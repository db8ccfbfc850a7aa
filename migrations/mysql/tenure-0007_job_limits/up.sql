-- Concurrency limits: at most limit_max running jobs per limit_key (one DDL statement).
ALTER TABLE tenure_jobs
    ADD COLUMN limit_key VARBINARY(255) NULL,
    ADD COLUMN limit_max INT NULL,
    ADD INDEX tenure_jobs_limit (limit_key, state);

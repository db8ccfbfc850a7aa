-- The limits jobs had before tenure_job_limits (one concurrency limit each).
INSERT INTO tenure_job_limits (job_id, limit_key, max_running)
    SELECT id, limit_key, limit_max FROM tenure_jobs WHERE limit_key IS NOT NULL;

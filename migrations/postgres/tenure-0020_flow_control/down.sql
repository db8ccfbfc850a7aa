DROP TABLE tenure_queue_limits;
ALTER TABLE tenure_limit_keys DROP COLUMN starts_kept;
ALTER TABLE tenure_limit_keys DROP COLUMN throttled_until;
ALTER TABLE tenure_limit_keys DROP COLUMN throttled_period_us;
ALTER TABLE tenure_limit_keys DROP COLUMN throttled_max;
DROP TABLE tenure_limit_starts;
DROP TABLE tenure_job_limits;

DROP TABLE dibs_queue_limits;
ALTER TABLE dibs_limit_keys DROP COLUMN rate_period_us;
ALTER TABLE dibs_limit_keys DROP COLUMN throttled_until;
DROP TABLE dibs_limit_starts;
DROP TABLE dibs_job_limits;

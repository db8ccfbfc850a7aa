DROP TABLE dibs_queue_limits;
ALTER TABLE dibs_limit_keys DROP COLUMN starts_kept;
ALTER TABLE dibs_limit_keys DROP COLUMN throttled_until;
ALTER TABLE dibs_limit_keys DROP COLUMN throttled_period_us;
ALTER TABLE dibs_limit_keys DROP COLUMN throttled_max;
DROP TABLE dibs_limit_starts;
DROP TABLE dibs_job_limits;

ALTER TABLE dibs_limit_keys DROP COLUMN throttled_until, DROP COLUMN rate_period_us;

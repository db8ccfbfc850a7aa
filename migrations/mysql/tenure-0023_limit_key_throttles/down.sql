ALTER TABLE tenure_limit_keys DROP COLUMN throttled_until, DROP COLUMN throttled_max,
    DROP COLUMN throttled_period_us, DROP COLUMN starts_kept;

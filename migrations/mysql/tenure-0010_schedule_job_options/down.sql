ALTER TABLE tenure_schedules
    DROP COLUMN delay_micros, DROP COLUMN limit_max, DROP COLUMN limit_key, DROP COLUMN dedup_key;

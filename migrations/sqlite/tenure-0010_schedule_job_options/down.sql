ALTER TABLE tenure_schedules DROP COLUMN delay_micros;
ALTER TABLE tenure_schedules DROP COLUMN limit_max;
ALTER TABLE tenure_schedules DROP COLUMN limit_key;
ALTER TABLE tenure_schedules DROP COLUMN dedup_key;

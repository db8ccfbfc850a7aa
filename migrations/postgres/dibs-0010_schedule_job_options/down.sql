ALTER TABLE dibs_schedules DROP COLUMN delay_micros;
ALTER TABLE dibs_schedules DROP COLUMN limit_max;
ALTER TABLE dibs_schedules DROP COLUMN limit_key;
ALTER TABLE dibs_schedules DROP COLUMN dedup_key;

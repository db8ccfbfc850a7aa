ALTER TABLE dibs_jobs DROP COLUMN cancel_requested_at;
ALTER TABLE dibs_jobs DROP COLUMN lapses;

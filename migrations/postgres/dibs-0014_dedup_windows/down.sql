DROP INDEX dibs_jobs_dedup_finished;
ALTER TABLE dibs_jobs DROP COLUMN dedup_window_micros;

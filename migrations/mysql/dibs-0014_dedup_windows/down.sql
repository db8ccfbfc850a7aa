ALTER TABLE dibs_jobs DROP INDEX dibs_jobs_dedup_finished, DROP COLUMN dedup_window_micros;

ALTER TABLE tenure_jobs DROP INDEX tenure_jobs_dedup_finished, DROP COLUMN dedup_window_micros;

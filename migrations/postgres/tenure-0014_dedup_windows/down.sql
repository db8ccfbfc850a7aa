DROP INDEX tenure_jobs_dedup_finished;
ALTER TABLE tenure_jobs DROP COLUMN dedup_window_micros;

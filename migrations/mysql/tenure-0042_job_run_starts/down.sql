ALTER TABLE tenure_jobs DROP COLUMN started_at;

ALTER TABLE tenure_jobs DROP COLUMN cancel_requested_at;
ALTER TABLE tenure_jobs DROP COLUMN lapses;

ALTER TABLE tenure_jobs DROP COLUMN cancel_requested_at, DROP COLUMN lapses;

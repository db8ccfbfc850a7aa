ALTER TABLE tenure_jobs DROP COLUMN claimed_by;
DROP TABLE tenure_workers;

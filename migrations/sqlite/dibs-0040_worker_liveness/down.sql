ALTER TABLE dibs_jobs DROP COLUMN claimed_by;
DROP TABLE dibs_workers;

ALTER TABLE tenure_jobs DROP INDEX tenure_jobs_limit, DROP COLUMN limit_max, DROP COLUMN limit_key;

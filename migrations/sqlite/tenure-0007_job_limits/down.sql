DROP TABLE tenure_limit_keys;
DROP INDEX tenure_jobs_limit;
ALTER TABLE tenure_jobs DROP COLUMN limit_max;
ALTER TABLE tenure_jobs DROP COLUMN limit_key;

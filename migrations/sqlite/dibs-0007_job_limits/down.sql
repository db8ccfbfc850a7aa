DROP TABLE dibs_limit_keys;
DROP INDEX dibs_jobs_limit;
ALTER TABLE dibs_jobs DROP COLUMN limit_max;
ALTER TABLE dibs_jobs DROP COLUMN limit_key;

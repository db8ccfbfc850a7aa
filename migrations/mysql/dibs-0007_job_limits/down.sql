ALTER TABLE dibs_jobs DROP INDEX dibs_jobs_limit, DROP COLUMN limit_max, DROP COLUMN limit_key;

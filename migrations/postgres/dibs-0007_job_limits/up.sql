-- Concurrency limits: at most limit_max running jobs per limit_key. Claimers of a key
-- serialize on its row in dibs_limit_keys (an upsert takes its lock).
ALTER TABLE dibs_jobs ADD COLUMN limit_key text COLLATE "C";
ALTER TABLE dibs_jobs ADD COLUMN limit_max integer;
CREATE INDEX dibs_jobs_limit ON dibs_jobs (limit_key) WHERE state = 'running' AND limit_key IS NOT NULL;
CREATE TABLE dibs_limit_keys (limit_key text COLLATE "C" NOT NULL PRIMARY KEY);

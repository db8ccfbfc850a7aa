-- Concurrency limits: at most limit_max running jobs per limit_key. Claimers of a key
-- serialize on its row in tenure_limit_keys (an upsert takes its lock).
ALTER TABLE tenure_jobs ADD COLUMN limit_key text COLLATE "C";
ALTER TABLE tenure_jobs ADD COLUMN limit_max integer;
CREATE INDEX tenure_jobs_limit ON tenure_jobs (limit_key) WHERE state = 'running' AND limit_key IS NOT NULL;
CREATE TABLE tenure_limit_keys (limit_key text COLLATE "C" NOT NULL PRIMARY KEY);

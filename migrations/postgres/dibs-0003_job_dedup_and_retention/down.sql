DROP INDEX dibs_jobs_queue_state;
DROP INDEX dibs_jobs_finished;
DROP INDEX dibs_jobs_dedup;
ALTER TABLE dibs_jobs DROP COLUMN dedup_hits;
ALTER TABLE dibs_jobs DROP COLUMN dedup_key;

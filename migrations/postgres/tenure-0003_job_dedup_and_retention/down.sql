DROP INDEX tenure_jobs_queue_state;
DROP INDEX tenure_jobs_finished;
DROP INDEX tenure_jobs_dedup;
ALTER TABLE tenure_jobs DROP COLUMN dedup_hits;
ALTER TABLE tenure_jobs DROP COLUMN dedup_key;

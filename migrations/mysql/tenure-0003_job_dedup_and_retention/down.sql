ALTER TABLE tenure_jobs DROP INDEX tenure_jobs_finished, DROP INDEX tenure_jobs_dedup,
    DROP COLUMN live_dedup_key, DROP COLUMN dedup_hits, DROP COLUMN dedup_key;

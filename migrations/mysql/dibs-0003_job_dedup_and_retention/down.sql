ALTER TABLE dibs_jobs DROP INDEX dibs_jobs_finished, DROP INDEX dibs_jobs_dedup,
    DROP COLUMN live_dedup_key, DROP COLUMN dedup_hits, DROP COLUMN dedup_key;

-- One ALTER (one DDL statement). No partial indexes here: live_dedup_key holds the key only
-- while the job is live (waiting or running), NULL otherwise, and a unique index on
-- (queue, live_dedup_key) allows any number of NULLs. dedup_hits counts the enqueues folded
-- into the job; it also lets an upsert report "existing" (2 affected rows) apart from
-- "inserted" (1). Retention reads finished jobs by finish time.
ALTER TABLE tenure_jobs
    ADD COLUMN IF NOT EXISTS dedup_key VARBINARY(255) NULL,
    ADD COLUMN IF NOT EXISTS dedup_hits INT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS live_dedup_key VARBINARY(255)
        AS (CASE WHEN state IN ('waiting', 'running') THEN dedup_key END) STORED,
    ADD UNIQUE INDEX IF NOT EXISTS tenure_jobs_dedup (queue, live_dedup_key),
    ADD INDEX IF NOT EXISTS tenure_jobs_finished (queue, state, finished_at, id);

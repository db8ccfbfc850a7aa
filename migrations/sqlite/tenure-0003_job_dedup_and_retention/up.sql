-- Deduplication: a key unique per queue among live (waiting or running) jobs; dedup_hits
-- counts the enqueues folded into the job. Retention reads finished jobs by finish time.
ALTER TABLE tenure_jobs ADD COLUMN dedup_key TEXT;
ALTER TABLE tenure_jobs ADD COLUMN dedup_hits INTEGER NOT NULL DEFAULT 0;
CREATE UNIQUE INDEX tenure_jobs_dedup ON tenure_jobs (queue, dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'running');
CREATE INDEX tenure_jobs_finished ON tenure_jobs (queue, state, finished_at, id)
    WHERE state IN ('completed', 'dead', 'cancelled');
-- Counts per queue and state (stats) read this index only.
CREATE INDEX tenure_jobs_queue_state ON tenure_jobs (queue, state);

-- Deduplication: a key unique per queue among live (waiting or running) jobs; dedup_hits
-- counts the enqueues folded into the job. Retention reads finished jobs by finish time.
ALTER TABLE dibs_jobs ADD COLUMN dedup_key text COLLATE "C";
ALTER TABLE dibs_jobs ADD COLUMN dedup_hits integer NOT NULL DEFAULT 0;
CREATE UNIQUE INDEX dibs_jobs_dedup ON dibs_jobs (queue, dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'running');
CREATE INDEX dibs_jobs_finished ON dibs_jobs (queue, state, finished_at, id)
    WHERE state IN ('completed', 'dead', 'cancelled');
-- Counts per queue and state (stats) read this index only.
CREATE INDEX dibs_jobs_queue_state ON dibs_jobs (queue, state);

-- Dedup windows: dedup_window_micros is how long after it finishes a keyed job still folds
-- enqueues of its key (NULL: only while live). It is the largest window any enqueue folded
-- into the job asked for, and retention keeps the job until finished_at + window, so a prune
-- never makes a window lie. Existing rows get NULL: no window, as before.
-- tenure_jobs_dedup_finished finds a finished twin of a key within a window.
ALTER TABLE tenure_jobs ADD COLUMN dedup_window_micros INTEGER;
CREATE INDEX tenure_jobs_dedup_finished ON tenure_jobs (queue, dedup_key, finished_at)
    WHERE dedup_key IS NOT NULL AND state IN ('completed', 'dead', 'cancelled');

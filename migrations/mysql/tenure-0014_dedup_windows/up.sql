-- Dedup windows: dedup_window_micros is how long after it finishes a keyed job still folds
-- enqueues of its key (NULL: only while live). It is the largest window any enqueue folded
-- into the job asked for, and retention keeps the job until finished_at + window, so a prune
-- never makes a window lie. Existing rows get NULL: no window, as before.
-- tenure_jobs_dedup_finished finds a finished twin of a key within a window (no partial
-- indexes here: state is in the key). One DDL statement (MySQL commits DDL implicitly).
ALTER TABLE tenure_jobs
    ADD COLUMN IF NOT EXISTS dedup_window_micros BIGINT NULL,
    ADD INDEX IF NOT EXISTS tenure_jobs_dedup_finished (queue, dedup_key, state, finished_at);

-- Sequences (strict order per key): a job enqueued with a sequence key runs after the one
-- enqueued before it with that key has completed. tenure_sequences holds, per key, the last
-- job enqueued with it; its row's lock orders the enqueues of a key. The successor waits by a
-- dependency edge on its predecessor (run_when 'sequence_hold' when a dead or cancelled
-- predecessor holds the rest until an operator acts, 'all_finished' when the rest go on).
ALTER TABLE tenure_jobs ADD COLUMN sequence_key text COLLATE "C";
CREATE TABLE tenure_sequences (
    sequence_key text COLLATE "C" NOT NULL PRIMARY KEY,
    last_job_id  bigint NOT NULL
);

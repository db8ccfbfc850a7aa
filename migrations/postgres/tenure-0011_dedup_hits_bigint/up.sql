-- dedup_hits counts the enqueues folded into a live job: a 32-bit integer made the
-- 2^31-th duplicate enqueue fail with "integer out of range". 64 bits cannot run out.
-- (Rewrites tenure_jobs under an exclusive lock: on a large table, run it at a quiet time.)
ALTER TABLE tenure_jobs ALTER COLUMN dedup_hits TYPE bigint;

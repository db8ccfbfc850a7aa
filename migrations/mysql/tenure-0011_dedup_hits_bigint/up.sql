-- dedup_hits counts the enqueues folded into a live job: a 32-bit INT made the 2^31-th
-- duplicate enqueue fail with "Out of range value". 64 bits cannot run out. One DDL
-- statement (it copies tenure_jobs: on a large table, run it at a quiet time).
ALTER TABLE tenure_jobs MODIFY COLUMN dedup_hits BIGINT NOT NULL DEFAULT 0;

-- Flow control. A job's limits, one row per key: a concurrency cap (max_running: at most so
-- many running jobs with this key) and/or a rate (at most rate_max starts per rate_period_us,
-- in any window of that length). tenure_jobs.limit_key and limit_max stay and name the job's
-- first limit, so "limit_key IS NOT NULL" says a job has rows here: a claim reads them only
-- then. Deleted with the job.
CREATE TABLE tenure_job_limits (
    job_id         bigint NOT NULL,
    limit_key      text COLLATE "C" NOT NULL,
    max_running    integer,
    rate_max       integer,
    rate_period_us bigint,
    PRIMARY KEY (job_id, limit_key)
);
INSERT INTO tenure_job_limits (job_id, limit_key, max_running)
    SELECT id, limit_key, limit_max FROM tenure_jobs WHERE limit_key IS NOT NULL;
-- The starts of rate-limited keys (a start's instant is its job's claimed_at), the newest
-- 10,000 or more per key: a claim counts them in its window.
CREATE TABLE tenure_limit_starts (
    limit_key  text COLLATE "C" NOT NULL,
    started_at timestamptz NOT NULL,
    job_id     bigint NOT NULL,
    PRIMARY KEY (limit_key, started_at, job_id)
);
-- throttled_until, throttled_max, throttled_period_us: the key's rate of throttled_max starts
-- per throttled_period_us is full until then. A hint for the claim's pick, which leaves out
-- the jobs whose rate on the key is that one or stricter (as many starts or fewer, in as long
-- a period or longer: full at least as long), so throttled jobs do not crowd out others; the
-- claim decides under the key's lock.
-- starts_kept: the key's rows in tenure_limit_starts. A rate needs at most its own count of the
-- newest starts (at most 10,000), whatever its period, so a key keeps its newest 10,000 and
-- trims the older ones once it holds twice that: no rate declared later finds a start missing.
ALTER TABLE tenure_limit_keys ADD COLUMN throttled_max integer;
ALTER TABLE tenure_limit_keys ADD COLUMN throttled_period_us bigint;
ALTER TABLE tenure_limit_keys ADD COLUMN throttled_until timestamptz;
ALTER TABLE tenure_limit_keys ADD COLUMN starts_kept bigint NOT NULL DEFAULT 0;
-- A queue-wide concurrency limit: at most max_running running jobs of the queue. Claimers of
-- a limited queue serialize on its row.
CREATE TABLE tenure_queue_limits (
    queue       text COLLATE "C" NOT NULL PRIMARY KEY,
    max_running integer NOT NULL
);

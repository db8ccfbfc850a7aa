-- throttled_until, throttled_max, throttled_period_us: the key's rate of throttled_max starts
-- per throttled_period_us is full until then. A hint for the claim's pick, which leaves out
-- the jobs whose rate on the key is that one or stricter (as many starts or fewer, in as long
-- a period or longer: full at least as long), so throttled jobs do not crowd out others; the
-- claim decides under the key's lock.
-- starts_kept: the key's rows in tenure_limit_starts. A rate needs at most its own count of the
-- newest starts (at most 10,000), whatever its period, so a key keeps its newest 10,000 and
-- trims the older ones once it holds twice that: no rate declared later finds a start missing.
-- One DDL statement.
ALTER TABLE tenure_limit_keys
    ADD COLUMN IF NOT EXISTS throttled_until DATETIME(6) NULL,
    ADD COLUMN IF NOT EXISTS throttled_max INT NULL,
    ADD COLUMN IF NOT EXISTS throttled_period_us BIGINT NULL,
    ADD COLUMN IF NOT EXISTS starts_kept BIGINT NOT NULL DEFAULT 0;

-- throttled_until: the key's rate window is full until then (a hint for the claim's pick, so
-- throttled jobs do not crowd out others; the claim decides under the key's lock).
-- rate_period_us: the longest rate period a claim used with the key (how long its starts are
-- kept). One DDL statement.
ALTER TABLE dibs_limit_keys
    ADD COLUMN throttled_until DATETIME(6) NULL,
    ADD COLUMN rate_period_us BIGINT NULL;

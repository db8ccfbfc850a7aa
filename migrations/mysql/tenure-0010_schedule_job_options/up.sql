-- The options of a schedule's job that every tick's job gets: a dedup key, a concurrency
-- limit, and a delay after the tick (0: due at the tick). One DDL statement.
ALTER TABLE tenure_schedules
    ADD COLUMN IF NOT EXISTS dedup_key VARBINARY(255) NULL,
    ADD COLUMN IF NOT EXISTS limit_key VARBINARY(255) NULL,
    ADD COLUMN IF NOT EXISTS limit_max INT NULL,
    ADD COLUMN IF NOT EXISTS delay_micros BIGINT NOT NULL DEFAULT 0;

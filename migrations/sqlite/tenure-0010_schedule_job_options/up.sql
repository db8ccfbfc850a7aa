-- The options of a schedule's job that every tick's job gets: a dedup key, a concurrency
-- limit, and a delay after the tick (0: due at the tick).
ALTER TABLE tenure_schedules ADD COLUMN dedup_key TEXT;
ALTER TABLE tenure_schedules ADD COLUMN limit_key TEXT;
ALTER TABLE tenure_schedules ADD COLUMN limit_max INTEGER;
ALTER TABLE tenure_schedules ADD COLUMN delay_micros INTEGER NOT NULL DEFAULT 0;

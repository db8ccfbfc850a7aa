-- The options of a schedule's job that every tick's job gets: a dedup key, a concurrency
-- limit, and a delay after the tick (0: due at the tick).
ALTER TABLE tenure_schedules ADD COLUMN dedup_key text COLLATE "C";
ALTER TABLE tenure_schedules ADD COLUMN limit_key text COLLATE "C";
ALTER TABLE tenure_schedules ADD COLUMN limit_max integer;
ALTER TABLE tenure_schedules ADD COLUMN delay_micros bigint NOT NULL DEFAULT 0;

-- Recurring schedules: a cron expression (in a time zone) or a fixed interval, the job to
-- enqueue at each tick, and the next tick. Firing is a compare-and-set on next_due_at.
CREATE TABLE tenure_schedules (
    name            TEXT    NOT NULL PRIMARY KEY,
    cron            TEXT,
    interval_micros INTEGER,
    time_zone       TEXT    NOT NULL,
    queue           TEXT    NOT NULL,
    kind            TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    priority        INTEGER NOT NULL,
    max_attempts    INTEGER NOT NULL,
    catch_up        INTEGER NOT NULL,
    paused          INTEGER NOT NULL DEFAULT 0,
    next_due_at     TEXT    NOT NULL
);

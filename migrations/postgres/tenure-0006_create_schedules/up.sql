-- Recurring schedules: a cron expression (in a time zone) or a fixed interval, the job to
-- enqueue at each tick, and the next tick. Firing is a compare-and-set on next_due_at.
CREATE TABLE tenure_schedules (
    name            text COLLATE "C" NOT NULL PRIMARY KEY,
    cron            text,
    interval_micros bigint,
    time_zone       text        NOT NULL,
    queue           text COLLATE "C" NOT NULL,
    kind            text COLLATE "C" NOT NULL,
    payload         bytea       NOT NULL,
    priority        integer     NOT NULL,
    max_attempts    integer     NOT NULL,
    catch_up        integer     NOT NULL,
    paused          integer     NOT NULL DEFAULT 0,
    next_due_at     timestamptz NOT NULL
);

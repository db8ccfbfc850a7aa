-- Recurring schedules: a cron expression (in a time zone) or a fixed interval, the job to
-- enqueue at each tick, and the next tick. Firing is a compare-and-set on next_due_at.
CREATE TABLE IF NOT EXISTS tenure_schedules (
    name            VARBINARY(255) NOT NULL PRIMARY KEY,
    cron            VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    interval_micros BIGINT         NULL,
    time_zone       VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    queue           VARBINARY(255) NOT NULL,
    kind            VARBINARY(255) NOT NULL,
    payload         LONGBLOB       NOT NULL,
    priority        INT            NOT NULL,
    max_attempts    INT            NOT NULL,
    catch_up        INT            NOT NULL,
    paused          INT            NOT NULL DEFAULT 0,
    next_due_at     DATETIME(6)    NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

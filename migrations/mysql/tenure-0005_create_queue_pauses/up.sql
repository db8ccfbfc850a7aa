-- A row per paused queue: claims skip it; enqueues still work.
CREATE TABLE IF NOT EXISTS tenure_queue_pauses (
    queue     VARBINARY(255) NOT NULL PRIMARY KEY,
    paused_at DATETIME(6)    NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

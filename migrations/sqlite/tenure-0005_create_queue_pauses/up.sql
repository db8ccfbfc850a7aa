-- A row per paused queue: claims skip it; enqueues still work.
CREATE TABLE tenure_queue_pauses (
    queue     TEXT NOT NULL PRIMARY KEY,
    paused_at TEXT NOT NULL
);

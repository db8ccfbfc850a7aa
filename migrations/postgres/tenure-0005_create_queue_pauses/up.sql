-- A row per paused queue: claims skip it; enqueues still work.
CREATE TABLE tenure_queue_pauses (
    queue     text COLLATE "C" NOT NULL PRIMARY KEY,
    paused_at timestamptz NOT NULL
);

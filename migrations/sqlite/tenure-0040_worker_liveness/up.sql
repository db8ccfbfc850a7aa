-- Running workers (see the PostgreSQL migration tenure-0040 for what each column means). On
-- SQLite every process is on one host: a worker holds an exclusive flock on the file
-- `<database>-workers/<id>` for its life, which the kernel releases when the process dies.
CREATE TABLE tenure_workers (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    host            TEXT    NOT NULL,
    pid             INTEGER NOT NULL,
    started_at      TEXT    NOT NULL,
    heartbeat_at    TEXT    NOT NULL,
    lock_free_since TEXT
);
-- claimed_by: the worker whose claim the job is running under (NULL outside a worker).
ALTER TABLE tenure_jobs ADD COLUMN claimed_by INTEGER;

-- The error of every failed run of a job (bounded: the newest 20 per job, 4 KiB each).
CREATE TABLE tenure_job_errors (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id    INTEGER NOT NULL,
    attempt   INTEGER NOT NULL,
    error     TEXT    NOT NULL,
    failed_at TEXT    NOT NULL
);
CREATE INDEX tenure_job_errors_job ON tenure_job_errors (job_id, id);

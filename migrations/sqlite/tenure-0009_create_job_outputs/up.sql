-- What a run printed and how it exited, for jobs whose runs report it (the `tenure work`
-- command's shell jobs). Bounded by the writer (64 KiB a run); deleted with the job.
CREATE TABLE tenure_job_outputs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id      INTEGER NOT NULL,
    attempt     INTEGER NOT NULL,
    exit_code   INTEGER NULL,
    output      BLOB    NOT NULL,
    finished_at TEXT    NOT NULL
);
CREATE INDEX tenure_job_outputs_job ON tenure_job_outputs (job_id, id);

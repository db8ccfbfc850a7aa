-- lapses: claims of this job that lapsed (its worker died or stalled); a lapsed claim does not
-- use an attempt, and a job is dead after tenure's MAX_LAPSES of them.
-- cancel_requested_at: a running job asked to cancel; it stays running (and holds its limit
-- key) until its worker records the run, or its claim lapses, then it is cancelled.
-- One DDL statement (MySQL commits DDL implicitly).
ALTER TABLE tenure_jobs
    ADD COLUMN IF NOT EXISTS lapses INT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS cancel_requested_at DATETIME(6) NULL;

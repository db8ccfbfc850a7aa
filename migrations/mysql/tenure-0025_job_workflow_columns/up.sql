-- Workflows (see the PostgreSQL migration tenure-0025 for what each column means). One DDL
-- statement (MySQL commits DDL implicitly). The workflow index has no state column: with no
-- partial indexes here, every job is in it, and a state in it would be one more index
-- entry rewritten by every claim and completion (measured: about a fifth of the drain
-- rate); a workflow's counts read its rows instead.
ALTER TABLE tenure_jobs
    ADD COLUMN IF NOT EXISTS workflow_id BIGINT NULL,
    ADD COLUMN IF NOT EXISTS run_when VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NULL,
    ADD COLUMN IF NOT EXISTS stripes_pending INT NULL,
    ADD COLUMN IF NOT EXISTS dependents INT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS progress DOUBLE NULL,
    ADD COLUMN IF NOT EXISTS progress_message TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    ADD INDEX IF NOT EXISTS tenure_jobs_workflow (workflow_id);

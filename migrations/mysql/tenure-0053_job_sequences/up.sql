-- Sequences (strict order per key): see the PostgreSQL migration of the same name.
ALTER TABLE tenure_jobs ADD COLUMN IF NOT EXISTS sequence_key VARBINARY(255) NULL;
CREATE TABLE IF NOT EXISTS tenure_sequences (
    sequence_key VARBINARY(255) NOT NULL PRIMARY KEY,
    last_job_id  BIGINT         NOT NULL
) ENGINE = InnoDB;

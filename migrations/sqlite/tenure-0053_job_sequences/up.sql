-- Sequences (strict order per key): see the PostgreSQL migration of the same name.
ALTER TABLE tenure_jobs ADD COLUMN sequence_key TEXT;
CREATE TABLE tenure_sequences (
    sequence_key TEXT    NOT NULL PRIMARY KEY,
    last_job_id  INTEGER NOT NULL
);

DROP TABLE tenure_sequences;
ALTER TABLE tenure_jobs DROP COLUMN sequence_key;

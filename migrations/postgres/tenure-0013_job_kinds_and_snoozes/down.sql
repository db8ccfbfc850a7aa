DROP INDEX tenure_jobs_claim_kind;
ALTER TABLE tenure_jobs DROP COLUMN snoozes;

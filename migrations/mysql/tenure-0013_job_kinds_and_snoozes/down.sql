ALTER TABLE tenure_jobs DROP INDEX tenure_jobs_claim_kind, DROP COLUMN snoozes;

DROP INDEX dibs_jobs_claim_kind;
ALTER TABLE dibs_jobs DROP COLUMN snoozes;

ALTER TABLE dibs_jobs DROP INDEX dibs_jobs_claim_kind, DROP COLUMN snoozes;

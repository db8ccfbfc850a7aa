DROP INDEX tenure_jobs_claim;
DROP INDEX tenure_jobs_claim_kind;
CREATE INDEX tenure_jobs_claim ON tenure_jobs (queue, priority, due_at, id) WHERE state = 'waiting';
CREATE INDEX tenure_jobs_claim_kind ON tenure_jobs (queue, kind, priority, due_at, id)
    WHERE state = 'waiting';
DROP INDEX tenure_jobs_fair;
DROP TABLE tenure_fair_keys;
ALTER TABLE tenure_jobs DROP COLUMN fair_stamp;
ALTER TABLE tenure_jobs DROP COLUMN fair_key;

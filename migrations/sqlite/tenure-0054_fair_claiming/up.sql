-- Fair claiming across tenants: see the PostgreSQL migration of the same name. SQLite's
-- claims read tenure_jobs' claim indexes, which now order by the stamp.
ALTER TABLE tenure_jobs ADD COLUMN fair_key TEXT;
ALTER TABLE tenure_jobs ADD COLUMN fair_stamp INTEGER NOT NULL DEFAULT 0;
CREATE TABLE tenure_fair_keys (
    queue    TEXT    NOT NULL,
    fair_key TEXT    NOT NULL,
    weight   INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (queue, fair_key)
);
CREATE INDEX tenure_jobs_fair ON tenure_jobs (queue, fair_key, priority, fair_stamp)
    WHERE state = 'waiting' AND fair_key IS NOT NULL;
DROP INDEX tenure_jobs_claim;
DROP INDEX tenure_jobs_claim_kind;
CREATE INDEX tenure_jobs_claim ON tenure_jobs (queue, priority, fair_stamp, due_at, id)
    WHERE state = 'waiting';
CREATE INDEX tenure_jobs_claim_kind ON tenure_jobs (queue, kind, priority, fair_stamp, due_at, id)
    WHERE state = 'waiting';

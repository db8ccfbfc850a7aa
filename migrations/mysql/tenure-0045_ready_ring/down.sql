DROP TRIGGER IF EXISTS tenure_ready_deleted;
DROP TRIGGER IF EXISTS tenure_ready_updated;
DROP TRIGGER IF EXISTS tenure_ready_inserted;
DROP TABLE IF EXISTS tenure_ready_ring;
DROP TABLE IF EXISTS tenure_ready;
ALTER TABLE tenure_jobs ADD INDEX IF NOT EXISTS tenure_jobs_claim_kind (queue, state, kind, priority, due_at, id);

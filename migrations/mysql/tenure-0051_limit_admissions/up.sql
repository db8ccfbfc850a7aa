-- A counter of admissions on each concurrency limit's row (internal: tenure::schema leaves it
-- out). Every claim that decides under a key's or a queue's limit adds one to it, so the
-- claim writes the row it locks: on a single server that is the lock it always took; on a
-- Galera cluster, where row locks are each node's own and only written rows are certified,
-- two claims of one limit on two nodes now conflict at commit (1213, retried) instead of
-- both admitting. Every statement can run again (MySQL commits DDL implicitly).
ALTER TABLE tenure_limit_keys ADD COLUMN IF NOT EXISTS admissions BIGINT NOT NULL DEFAULT 0;
ALTER TABLE tenure_queue_limits ADD COLUMN IF NOT EXISTS admissions BIGINT NOT NULL DEFAULT 0;

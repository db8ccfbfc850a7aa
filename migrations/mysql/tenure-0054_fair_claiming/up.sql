-- Fair claiming across tenants: see the PostgreSQL migration of the same name. Every
-- statement can run again (Galera: migrators on two nodes may both run it); the claim
-- indexes are dropped and made again in one statement.
ALTER TABLE tenure_jobs ADD COLUMN IF NOT EXISTS fair_key VARBINARY(255) NULL,
    ADD COLUMN IF NOT EXISTS fair_stamp BIGINT NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS tenure_fair_keys (
    queue    VARBINARY(255) NOT NULL,
    fair_key VARBINARY(255) NOT NULL,
    weight   INT NOT NULL DEFAULT 1,
    PRIMARY KEY (queue, fair_key)
) ENGINE = InnoDB;

ALTER TABLE tenure_ready ADD COLUMN IF NOT EXISTS fair_stamp BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS fair_key VARBINARY(255) NULL,
    ADD INDEX IF NOT EXISTS tenure_ready_fair (fair_key, queue, priority, fair_stamp),
    DROP INDEX tenure_ready_claim, DROP INDEX tenure_ready_claim_kind,
    ADD INDEX tenure_ready_claim (queue, priority, fair_stamp, due_at, id),
    ADD INDEX tenure_ready_claim_kind (queue, kind, priority, fair_stamp, due_at, id);

CREATE OR REPLACE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs FOR EACH ROW
BEGIN
    DECLARE ring_slot TINYINT;
    IF NEW.state = 'waiting' THEN
        SELECT generation % 3 INTO ring_slot FROM tenure_ready_ring WHERE one = 1;
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key)
        VALUES (ring_slot, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key,
                NEW.fair_stamp, NEW.fair_key);
    END IF;
END;

CREATE OR REPLACE TRIGGER tenure_ready_updated AFTER UPDATE ON tenure_jobs FOR EACH ROW
BEGIN
    DECLARE ring_slot TINYINT;
    DECLARE moved BOOLEAN DEFAULT NOT (OLD.id <=> NEW.id
        AND OLD.queue <=> NEW.queue AND OLD.kind <=> NEW.kind
        AND OLD.priority <=> NEW.priority AND OLD.due_at <=> NEW.due_at
        AND OLD.limit_key <=> NEW.limit_key AND OLD.fair_stamp <=> NEW.fair_stamp
        AND OLD.fair_key <=> NEW.fair_key);
    IF OLD.state = 'waiting' AND (NEW.state <> 'waiting' OR moved) THEN
        DELETE FROM tenure_ready WHERE id = OLD.id;
    END IF;
    IF NEW.state = 'waiting' AND (OLD.state <> 'waiting' OR moved) THEN
        SELECT generation % 3 INTO ring_slot FROM tenure_ready_ring WHERE one = 1;
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key)
        VALUES (ring_slot, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key,
                NEW.fair_stamp, NEW.fair_key);
    END IF;
END;

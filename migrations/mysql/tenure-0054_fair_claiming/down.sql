DROP TRIGGER IF EXISTS tenure_ready_inserted;
CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs FOR EACH ROW
BEGIN
    DECLARE ring_slot TINYINT;
    IF NEW.state = 'waiting' THEN
        SELECT generation % 3 INTO ring_slot FROM tenure_ready_ring WHERE one = 1;
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
        VALUES (ring_slot, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key);
    END IF;
END;

DROP TRIGGER IF EXISTS tenure_ready_updated;
CREATE TRIGGER tenure_ready_updated AFTER UPDATE ON tenure_jobs FOR EACH ROW
BEGIN
    DECLARE ring_slot TINYINT;
    DECLARE moved BOOLEAN DEFAULT NOT (OLD.id <=> NEW.id
        AND OLD.queue <=> NEW.queue AND OLD.kind <=> NEW.kind
        AND OLD.priority <=> NEW.priority AND OLD.due_at <=> NEW.due_at
        AND OLD.limit_key <=> NEW.limit_key);
    IF OLD.state = 'waiting' AND (NEW.state <> 'waiting' OR moved) THEN
        DELETE FROM tenure_ready WHERE id = OLD.id;
    END IF;
    IF NEW.state = 'waiting' AND (OLD.state <> 'waiting' OR moved) THEN
        SELECT generation % 3 INTO ring_slot FROM tenure_ready_ring WHERE one = 1;
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
        VALUES (ring_slot, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key);
    END IF;
END;

ALTER TABLE tenure_ready DROP INDEX tenure_ready_claim, DROP INDEX tenure_ready_claim_kind,
    DROP INDEX tenure_ready_fair, DROP COLUMN fair_stamp, DROP COLUMN fair_key,
    ADD INDEX tenure_ready_claim (queue, priority, due_at, id),
    ADD INDEX tenure_ready_claim_kind (queue, kind, priority, due_at, id);
DROP TABLE IF EXISTS tenure_fair_keys;
ALTER TABLE tenure_jobs DROP COLUMN fair_stamp, DROP COLUMN fair_key;

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

ALTER TABLE tenure_jobs DROP COLUMN IF EXISTS ready_entry_by_insert;

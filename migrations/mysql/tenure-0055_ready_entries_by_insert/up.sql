-- A bulk enqueue writes its jobs' ready entries itself, one statement a chunk, instead of the
-- ring's row trigger writing them one row at a time (docs/storage-design.md, "What is next for
-- MariaDB": a row trigger costs about 10 us a row even when it does nothing, and this one read
-- the generation and wrote the entry per row; MariaDB has no statement triggers). The rows such
-- an insert makes carry `ready_entry_by_insert`, and the trigger passes them by; every other
-- insert (one job, an older tenure still running beside a newer one, anything else) gets its
-- entry from the trigger as before. A column, not a session variable: it cannot outlive its
-- statement. Every statement can run again (Galera: migrators on two nodes may both run it).
ALTER TABLE tenure_jobs ADD COLUMN IF NOT EXISTS ready_entry_by_insert BOOLEAN NOT NULL DEFAULT FALSE;

CREATE OR REPLACE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs FOR EACH ROW
BEGIN
    DECLARE ring_slot TINYINT;
    IF NEW.state = 'waiting' AND NOT NEW.ready_entry_by_insert THEN
        SELECT generation % 3 INTO ring_slot FROM tenure_ready_ring WHERE one = 1;
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key)
        VALUES (ring_slot, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key,
                NEW.fair_stamp, NEW.fair_key);
    END IF;
END;

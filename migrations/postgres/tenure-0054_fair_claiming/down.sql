CREATE OR REPLACE FUNCTION tenure_ready_inserted() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
    SELECT (SELECT last_value % 3 FROM tenure_ready_generation), n.id, n.queue, n.kind,
           n.priority, n.due_at, n.limit_key
    FROM added n WHERE n.state = 'waiting';
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION tenure_ready_updated() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF OLD.state = 'waiting' THEN
        DELETE FROM tenure_ready WHERE id = OLD.id;
        IF NOT FOUND AND current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'could not serialize access due to a concurrent rotation of the ready ring (job %)', OLD.id
                USING ERRCODE = 'serialization_failure';
        END IF;
    END IF;
    IF NEW.state = 'waiting' THEN
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
        SELECT last_value % 3, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at,
               NEW.limit_key
        FROM tenure_ready_generation;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION tenure_rotate_ready(min_interval_us bigint) RETURNS bigint LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    current_generation bigint;
    oldest text;
    moved bigint;
BEGIN
    -- Each statement must read afresh, after the slot's lock (READ COMMITTED, which
    -- `rotate_ready` begins): a copy under an older snapshot (REPEATABLE READ, SERIALIZABLE)
    -- would miss the entries committed since, and the truncate would remove them.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'tenure_rotate_ready needs a READ COMMITTED transaction, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'invalid_transaction_state';
    END IF;
    IF NOT pg_try_advisory_xact_lock(8387231331756879474) THEN
        RETURN -1;
    END IF;
    SELECT generation INTO current_generation FROM tenure_ready_ring
    WHERE rotated_at + min_interval_us * interval '1 microsecond' <= statement_timestamp();
    IF NOT FOUND THEN
        RETURN -1;
    END IF;
    oldest := 'tenure_ready_' || ((current_generation + 1) % 3);
    EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %I LIMIT 2001) AS waiting', oldest)
        INTO moved;
    IF moved > 2000 THEN
        RETURN -3;
    END IF;
    BEGIN
        EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', oldest);
    EXCEPTION WHEN lock_not_available THEN
        RETURN -2;
    END;
    EXECUTE format('INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key) '
        'SELECT $1, id, queue, kind, priority, due_at, limit_key FROM %I', oldest)
        USING (current_generation % 3)::smallint;
    GET DIAGNOSTICS moved = ROW_COUNT;
    EXECUTE format('TRUNCATE %I', oldest);
    UPDATE tenure_ready_ring SET generation = current_generation + 1,
        rotated_at = statement_timestamp();
    PERFORM setval('tenure_ready_generation', current_generation + 1);
    RETURN moved;
END $$;
DROP INDEX tenure_ready_claim;
DROP INDEX tenure_ready_claim_kind;
DROP INDEX tenure_ready_fair;
ALTER TABLE tenure_ready DROP COLUMN fair_stamp, DROP COLUMN fair_key;
CREATE INDEX tenure_ready_claim ON tenure_ready (queue, priority, due_at, id);
CREATE INDEX tenure_ready_claim_kind ON tenure_ready (queue, kind, priority, due_at, id);
DROP TABLE tenure_fair_keys;
ALTER TABLE tenure_jobs DROP COLUMN fair_stamp, DROP COLUMN fair_key;

-- Fair claiming across tenants (src/jobs/flow/fairness.rs): a job enqueued with a fair key
-- gets a stamp, its tenant's turn in the queue's virtual time (start-time fair queueing);
-- claims order by priority, then stamp, then due time. A job without a fair key has stamp 0,
-- so a queue that uses none of this claims in the order it always did. Both columns are
-- outside tenure::schema (tenure_jobs has diesel's 32 columns; 64 would double every user's
-- diesel build).
ALTER TABLE tenure_jobs ADD COLUMN fair_key text COLLATE "C",
    ADD COLUMN fair_stamp bigint NOT NULL DEFAULT 0;
-- Per queue and tenant: its weight; the row's lock orders the tenant's enqueues (no two of
-- its jobs share a turn, however many producers).
CREATE TABLE tenure_fair_keys (
    queue    text COLLATE "C" NOT NULL,
    fair_key text COLLATE "C" NOT NULL,
    weight   integer NOT NULL DEFAULT 1,
    PRIMARY KEY (queue, fair_key)
);

-- The ring carries the stamp (its claim indexes order by it) and the tenant (a tenant's
-- last waiting turn per priority, which its next enqueue reads).
ALTER TABLE tenure_ready ADD COLUMN fair_stamp bigint NOT NULL DEFAULT 0,
    ADD COLUMN fair_key text COLLATE "C";
CREATE INDEX tenure_ready_fair ON tenure_ready (queue, fair_key, priority, fair_stamp)
    WHERE fair_key IS NOT NULL;
DROP INDEX tenure_ready_claim;
DROP INDEX tenure_ready_claim_kind;
CREATE INDEX tenure_ready_claim ON tenure_ready (queue, priority, fair_stamp, due_at, id);
CREATE INDEX tenure_ready_claim_kind ON tenure_ready (queue, kind, priority, fair_stamp, due_at, id);

CREATE OR REPLACE FUNCTION tenure_ready_inserted() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key)
    SELECT (SELECT last_value % 3 FROM tenure_ready_generation), n.id, n.queue, n.kind,
           n.priority, n.due_at, n.limit_key, n.fair_stamp, n.fair_key
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
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key)
        SELECT last_value % 3, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at,
               NEW.limit_key, NEW.fair_stamp, NEW.fair_key
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
    EXECUTE format('INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key) '
        'SELECT $1, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key FROM %I', oldest)
        USING (current_generation % 3)::smallint;
    GET DIAGNOSTICS moved = ROW_COUNT;
    EXECUTE format('TRUNCATE %I', oldest);
    UPDATE tenure_ready_ring SET generation = current_generation + 1,
        rotated_at = statement_timestamp();
    PERFORM setval('tenure_ready_generation', current_generation + 1);
    RETURN moved;
END $$;

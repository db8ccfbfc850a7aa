-- The ready ring (docs/storage-design.md): one entry per waiting job, in three partitions
-- the rotation empties by TRUNCATE, so that the dead entries claims leave behind are
-- reclaimed whatever snapshot another transaction holds (vacuum cannot remove them while
-- one is held, and tenure_jobs' claim index filled with them: claims walked every job
-- claimed since the oldest snapshot began). Claims read only this table; triggers on
-- tenure_jobs keep it exact (an entry exists if and only if the job is waiting), so no
-- statement that changes a job can forget it.
CREATE TABLE tenure_ready (
    slot      smallint NOT NULL,
    id        bigint   NOT NULL,
    queue     text COLLATE "C" NOT NULL,
    kind      text COLLATE "C" NOT NULL,
    priority  integer     NOT NULL,
    due_at    timestamptz NOT NULL,
    limit_key text COLLATE "C"
) PARTITION BY LIST (slot);
CREATE TABLE tenure_ready_0 PARTITION OF tenure_ready FOR VALUES IN (0);
CREATE TABLE tenure_ready_1 PARTITION OF tenure_ready FOR VALUES IN (1);
CREATE TABLE tenure_ready_2 PARTITION OF tenure_ready FOR VALUES IN (2);
-- The claim's filter and order, of any kind and of one kind; the triggers' by id.
CREATE INDEX tenure_ready_claim ON tenure_ready (queue, priority, due_at, id);
CREATE INDEX tenure_ready_claim_kind ON tenure_ready (queue, kind, priority, due_at, id);
CREATE INDEX tenure_ready_id ON tenure_ready (id);
-- The generation new entries go to (its value modulo 3 is their slot). A sequence: moved on
-- by each rotation without a row version (a one-row table would pile up dead versions of
-- its own under a held snapshot, read by every enqueue).
CREATE SEQUENCE tenure_ready_generation MINVALUE 0 START 0;

-- The triggers' functions and the rotation run as the owner who migrated (SECURITY DEFINER):
-- an application user with only row privileges on the tables (README's least privileges)
-- needs none on the sequence, nor TRUNCATE.
CREATE FUNCTION tenure_ready_inserted() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
    SELECT (SELECT last_value % 3 FROM tenure_ready_generation), n.id, n.queue, n.kind,
           n.priority, n.due_at, n.limit_key
    FROM added n WHERE n.state = 'waiting';
    RETURN NULL;
END $$;

-- A job leaves the ring when it stops waiting, and moves when what claims read of it
-- changes while it waits (a replacing duplicate). Row triggers with a WHEN: a finish, a
-- heartbeat or retention's delete of finished jobs never calls them. A claim, the one
-- statement that makes jobs running, deletes the entries it took itself, in one statement
-- (`claim_forget`): no other statement of tenure's makes a job running (tenure_jobs is
-- read-only to applications, README's schema contract).
-- A waiting job's entry not found: a rotation moved it after the snapshot of a caller's
-- REPEATABLE READ or SERIALIZABLE transaction (the copy is too new to see, the slot it left
-- truncated). Deleting nothing would leave the copy listing a job that no longer waits, for
-- a claim to take (claims trust the ring); the transaction fails instead, as for any row
-- changed since its snapshot. (A READ COMMITTED statement waits for the rotation's slot
-- lock, then reads afresh.)
CREATE FUNCTION tenure_ready_updated() RETURNS trigger LANGUAGE plpgsql
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

CREATE FUNCTION tenure_ready_deleted() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM tenure_ready WHERE id = OLD.id;
    IF NOT FOUND AND current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'could not serialize access due to a concurrent rotation of the ready ring (job %)', OLD.id
            USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN NULL;
END $$;

-- A statement trigger over its transition table for inserts: a bulk enqueue of 10,000 jobs
-- is one insert into the ring, not 10,000 function calls.
CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION tenure_ready_inserted();
CREATE TRIGGER tenure_ready_updated
    AFTER UPDATE OF state, queue, kind, priority, due_at, limit_key ON tenure_jobs
    FOR EACH ROW WHEN (
        (OLD.state = 'waiting' AND NEW.state NOT IN ('waiting', 'running'))
        OR (NEW.state = 'waiting' AND (OLD.state <> 'waiting'
            OR (OLD.queue, OLD.kind, OLD.priority, OLD.due_at, OLD.limit_key)
               IS DISTINCT FROM (NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key))))
    EXECUTE FUNCTION tenure_ready_updated();
CREATE TRIGGER tenure_ready_deleted AFTER DELETE ON tenure_jobs
    FOR EACH ROW WHEN (OLD.state = 'waiting') EXECUTE FUNCTION tenure_ready_deleted();

-- Claims no longer read tenure_jobs' claim indexes: every job's insert and state change
-- stops paying for them (the queue's other readers use tenure_jobs_queue_state).
DROP INDEX tenure_jobs_claim;
DROP INDEX tenure_jobs_claim_kind;

-- The jobs waiting now enter the ring (the migration holds the migration lock, which
-- workers wait for: no claim runs meanwhile).
INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
SELECT 0, id, queue, kind, priority, due_at, limit_key FROM tenure_jobs WHERE state = 'waiting';

-- The rotation's state: the generation (the sequence's value, kept here with the time of the
-- last rotation, which rotations read; one row, one version per rotation).
CREATE TABLE tenure_ready_ring (
    generation bigint      NOT NULL,
    rotated_at timestamptz NOT NULL
);
INSERT INTO tenure_ready_ring (generation, rotated_at) VALUES (0, statement_timestamp());

-- A rotation (`jobs::rotate_ready`), if the last is at least `min_interval_us` old by the
-- database's clock: the oldest slot, locked NOWAIT (a rotation never waits in the lock
-- queue, where claims would queue behind it), gives its waiting entries to the current slot
-- and is truncated, and the generation moves on, in the caller's transaction. Returns how
-- many entries moved; -1 when not due or another rotation holds the rotation lock ("tenure.r"
-- as a transaction advisory lock); -2 when another transaction uses the slot; -3 when more
-- than 2,000 entries still wait in it (a backlog, jobs due later): moving them holds every
-- claim behind the slot's lock for as long (100,000 took 849 ms), so the ring waits until
-- claims have taken them (the backlog's oldest entries are the first claimed).
CREATE FUNCTION tenure_rotate_ready(min_interval_us bigint) RETURNS bigint LANGUAGE plpgsql
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

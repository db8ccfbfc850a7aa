-- Job slots (docs/storage-design.md, "What the records' step built"): tenure_jobs becomes a
-- table partitioned by `slot`, six slots that new jobs fill in turn and a seventh, `kept`,
-- for jobs with a dedup key. A job stays in its slot for life (nothing moves it: a moved row
-- would be invisible to a snapshot taken before the move, and its old version gone with the
-- truncate). Once retention has deleted every job of a slot, a rotation reclaims the slot's
-- space, dead row versions and index entries included, by TRUNCATE, which needs no vacuum
-- and ignores snapshots; while any transaction holds an old snapshot, deletes alone leave
-- every finished job's versions for claims, finishes and prunes to walk, and without
-- autovacuum nothing ever reclaims them.
--
-- Keyed jobs live in `kept`, reclaimed by deletes and vacuum as before: a dedup key is
-- unique among live jobs, and a unique index of a partitioned table must hold its
-- partitioning column, so the key's index is `kept`'s own, and every keyed job is there
-- (the slots refuse a key: CHECK).

ALTER TABLE tenure_jobs RENAME TO tenure_jobs_unsliced;
-- Its names are the new table's: its indexes go (the copy below reads it whole), its key and
-- id sequence are renamed.
DROP INDEX tenure_jobs_dedup, tenure_jobs_stalled, tenure_jobs_finished, tenure_jobs_queue_state,
    tenure_jobs_limit, tenure_jobs_dedup_finished, tenure_jobs_workflow;
ALTER TABLE tenure_jobs_unsliced RENAME CONSTRAINT tenure_jobs_pkey TO tenure_jobs_unsliced_pkey;
ALTER SEQUENCE tenure_jobs_id_seq RENAME TO tenure_jobs_unsliced_id_seq;

-- The slot new jobs go to (0-5): its value, read by the column's default. A sequence: moved by
-- a rotation without a row version, read without a lock.
CREATE SEQUENCE tenure_jobs_slot MINVALUE 0 MAXVALUE 5 START 0;
SELECT setval('tenure_jobs_slot', 0, true);
-- Read by every insert's default, whoever inserts (README's least-privileged user too).
GRANT SELECT ON SEQUENCE tenure_jobs_slot TO PUBLIC;

-- Ids from a sequence of the table's (an identity column's default does not reach an insert
-- into a partition named directly, as keyed jobs are).
CREATE SEQUENCE tenure_jobs_id_seq;
CREATE TABLE tenure_jobs (
    id                  bigint      NOT NULL DEFAULT nextval('tenure_jobs_id_seq'::regclass),
    queue               text COLLATE "C" NOT NULL,
    kind                text COLLATE "C" NOT NULL,
    payload             bytea       NOT NULL,
    priority            integer     NOT NULL DEFAULT 0,
    state               text        NOT NULL,
    attempt             integer     NOT NULL DEFAULT 0,
    max_attempts        integer     NOT NULL,
    due_at              timestamptz NOT NULL,
    created_at          timestamptz NOT NULL,
    claim_token         uuid,
    claimed_at          timestamptz,
    claim_expires_at    timestamptz,
    finished_at         timestamptz,
    last_error          text,
    dedup_key           text COLLATE "C",
    dedup_hits          bigint      NOT NULL DEFAULT 0,
    limit_key           text COLLATE "C",
    limit_max           integer,
    lapses              integer     NOT NULL DEFAULT 0,
    cancel_requested_at timestamptz,
    snoozes             integer     NOT NULL DEFAULT 0,
    dedup_window_micros bigint,
    workflow_id         bigint,
    run_when            text,
    stripes_pending     integer,
    dependents          integer     NOT NULL DEFAULT 0,
    progress            double precision,
    progress_message    text,
    claimed_by          bigint,
    started_at          timestamptz,
    slot                smallint    NOT NULL
        DEFAULT pg_sequence_last_value('tenure_jobs_slot'::regclass)::smallint,
    PRIMARY KEY (id, slot)
) PARTITION BY LIST (slot);
ALTER SEQUENCE tenure_jobs_id_seq OWNED BY tenure_jobs.id;
-- An insert takes its id from it, whoever inserts (README's least-privileged user needed
-- INSERT alone with the identity column this replaces). Taking an id is all it allows.
GRANT USAGE ON SEQUENCE tenure_jobs_id_seq TO PUBLIC;

CREATE TABLE tenure_jobs_0 PARTITION OF tenure_jobs (CHECK (dedup_key IS NULL)) FOR VALUES IN (0);
CREATE TABLE tenure_jobs_1 PARTITION OF tenure_jobs (CHECK (dedup_key IS NULL)) FOR VALUES IN (1);
CREATE TABLE tenure_jobs_2 PARTITION OF tenure_jobs (CHECK (dedup_key IS NULL)) FOR VALUES IN (2);
CREATE TABLE tenure_jobs_3 PARTITION OF tenure_jobs (CHECK (dedup_key IS NULL)) FOR VALUES IN (3);
CREATE TABLE tenure_jobs_4 PARTITION OF tenure_jobs (CHECK (dedup_key IS NULL)) FOR VALUES IN (4);
CREATE TABLE tenure_jobs_5 PARTITION OF tenure_jobs (CHECK (dedup_key IS NULL)) FOR VALUES IN (5);
CREATE TABLE tenure_jobs_kept PARTITION OF tenure_jobs FOR VALUES IN (-1);
-- A keyed job is inserted into `kept` itself (`INSERT INTO tenure_jobs_kept AS tenure_jobs`:
-- its upsert's arbiter is this partition's index), where the slot is this.
ALTER TABLE tenure_jobs_kept ALTER COLUMN slot SET DEFAULT -1;

CREATE UNIQUE INDEX tenure_jobs_dedup ON tenure_jobs_kept (queue, dedup_key)
    WHERE dedup_key IS NOT NULL AND state IN ('waiting', 'running');
CREATE INDEX tenure_jobs_stalled ON tenure_jobs (claim_expires_at) WHERE state = 'running';
CREATE INDEX tenure_jobs_finished ON tenure_jobs (queue, state, finished_at, id)
    WHERE state IN ('completed', 'dead', 'cancelled');
CREATE INDEX tenure_jobs_queue_state ON tenure_jobs (queue, state);
CREATE INDEX tenure_jobs_limit ON tenure_jobs (limit_key)
    WHERE state = 'running' AND limit_key IS NOT NULL;
CREATE INDEX tenure_jobs_dedup_finished ON tenure_jobs (queue, dedup_key, finished_at)
    WHERE dedup_key IS NOT NULL AND state IN ('completed', 'dead', 'cancelled');
CREATE INDEX tenure_jobs_workflow ON tenure_jobs (workflow_id, state) WHERE workflow_id IS NOT NULL;

-- Every partition turns over its rows as the whole table did (tenure-0032): vacuumed (where
-- autovacuum runs) after a fixed number of dead versions, so that a slot reuses its space
-- before its truncate; `kept`, never truncated, relies on it alone.
DO $$
BEGIN
    FOR n IN 0..5 LOOP
        EXECUTE format('ALTER TABLE %I SET (autovacuum_vacuum_scale_factor = 0, '
            'autovacuum_vacuum_threshold = 5000, autovacuum_vacuum_cost_delay = 1, '
            'autovacuum_analyze_scale_factor = 0.05)', 'tenure_jobs_' || n);
    END LOOP;
END $$;
ALTER TABLE tenure_jobs_kept SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 1,
    autovacuum_analyze_scale_factor = 0.05
);

-- The live database's jobs move in (the migration holds the migration lock, which workers
-- wait for), ids kept; the ready ring's entries name them by id and stay as they are.
INSERT INTO tenure_jobs (id, queue, kind, payload, priority, state, attempt, max_attempts, due_at,
    created_at, claim_token, claimed_at, claim_expires_at, finished_at, last_error, dedup_key,
    dedup_hits, limit_key, limit_max, lapses, cancel_requested_at, snoozes, dedup_window_micros,
    workflow_id, run_when, stripes_pending, dependents, progress, progress_message, claimed_by,
    started_at, slot)
SELECT id, queue, kind, payload, priority, state, attempt, max_attempts, due_at,
    created_at, claim_token, claimed_at, claim_expires_at, finished_at, last_error, dedup_key,
    dedup_hits, limit_key, limit_max, lapses, cancel_requested_at, snoozes, dedup_window_micros,
    workflow_id, run_when, stripes_pending, dependents, progress, progress_message, claimed_by,
    started_at, CASE WHEN dedup_key IS NULL THEN 0 ELSE -1 END
FROM tenure_jobs_unsliced;

-- Ids go on from where the old table's left off (never reused: a pruned job's id may still
-- be named elsewhere, in an application's own rows), and whoever had privileges on the old
-- table has them on the new one.
DO $$
DECLARE
    last bigint := GREATEST(
        COALESCE(pg_sequence_last_value(pg_get_serial_sequence('tenure_jobs_unsliced', 'id')::regclass), 0),
        COALESCE((SELECT max(id) FROM tenure_jobs), 0));
    grant_row record;
BEGIN
    IF last > 0 THEN
        PERFORM setval(pg_get_serial_sequence('tenure_jobs', 'id'), last, true);
    END IF;
    FOR grant_row IN
        SELECT a.privilege_type, a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'tenure_jobs_unsliced'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON tenure_jobs TO %s%s', grant_row.privilege_type,
            CASE WHEN grant_row.grantee = 0 THEN 'PUBLIC'
                 ELSE quote_ident(pg_get_userbyid(grant_row.grantee)) END,
            CASE WHEN grant_row.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END $$;

DROP TABLE tenure_jobs_unsliced;

-- The ready ring's triggers (tenure-0045), on the new table; inserts into `kept` named
-- directly fire its own statement trigger (a parent's statement triggers fire only for
-- statements that name the parent).
CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION tenure_ready_inserted();
CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs_kept
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

-- When the slots last turned (one row; one version a rotation).
CREATE TABLE tenure_jobs_rotation (rotated_at timestamptz NOT NULL);
INSERT INTO tenure_jobs_rotation (rotated_at) VALUES (statement_timestamp());

-- A rotation (`jobs::rotate_job_slots`), if the last is at least `min_interval_us` old by the
-- database's clock: the first slot after the current one that holds no job is truncated and
-- becomes current. Its exclusive lock is waited for `lock_wait_ms` at most (every statement
-- on tenure_jobs that arrives meanwhile waits behind it, so never longer; a busy queue rarely
-- leaves a slot unlocked for an instant, so NOWAIT alone was rarely granted), and the slot is
-- checked empty under it: no writer can hold a row lock there then, and a slot with a job
-- still in it (waiting, running, kept by retention) is never truncated; nothing is moved.
-- Returns the new current slot; -1 when not due or another rotation holds the rotation lock
-- ("tenure.j" as a transaction advisory lock); -2 when the empty slot's lock was not granted
-- in time (the caller tries again a little later); -3 when no other slot is empty (retention
-- keeps jobs longer than the slots turn, or a job runs long: new jobs go on filling the
-- current slot).
CREATE FUNCTION tenure_rotate_job_slots(min_interval_us bigint, lock_wait_ms integer)
    RETURNS bigint LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    current_slot integer;
    candidate integer;
    partition text;
    busy boolean;
BEGIN
    -- The check under the lock must read afresh (READ COMMITTED): under an older snapshot a
    -- job committed since would look absent, and the truncate would remove it.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'tenure_rotate_job_slots needs a READ COMMITTED transaction, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'invalid_transaction_state';
    END IF;
    IF NOT pg_try_advisory_xact_lock(8387231331756879466) THEN
        RETURN -1;
    END IF;
    PERFORM 1 FROM tenure_jobs_rotation
    WHERE rotated_at + min_interval_us * interval '1 microsecond' <= statement_timestamp();
    IF NOT FOUND THEN
        RETURN -1;
    END IF;
    current_slot := pg_sequence_last_value('tenure_jobs_slot'::regclass);
    FOR step IN 1..5 LOOP
        candidate := (current_slot + step) % 6;
        partition := 'tenure_jobs_' || candidate;
        -- A look without the lock first: a slot still holding jobs is not locked at all.
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', partition) INTO busy;
        CONTINUE WHEN busy;
        PERFORM set_config('lock_timeout', GREATEST(lock_wait_ms, 1) || 'ms', true);
        BEGIN
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', partition);
        EXCEPTION WHEN lock_not_available THEN
            RETURN -2;
        END;
        PERFORM set_config('lock_timeout', '0', true);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', partition) INTO busy;
        IF busy THEN
            -- A job came in meanwhile (a statement that read the slot before it stopped being
            -- current): left for a later rotation.
            RETURN -3;
        END IF;
        EXECUTE format('TRUNCATE %I', partition);
        -- Not transactional: inserts go to the new slot at once, and wait for its lock until
        -- this commits.
        PERFORM setval('tenure_jobs_slot', candidate, true);
        UPDATE tenure_jobs_rotation SET rotated_at = statement_timestamp();
        RETURN candidate;
    END LOOP;
    RETURN -3;
END $$;

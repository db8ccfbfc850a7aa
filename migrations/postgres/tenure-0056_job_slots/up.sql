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
    sequence_key        text COLLATE "C",
    fair_key            text COLLATE "C",
    fair_stamp          bigint      NOT NULL DEFAULT 0,
    slot                smallint    NOT NULL
        DEFAULT pg_sequence_last_value('tenure_jobs_slot'::regclass)::smallint
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

-- The key: each slot's own unique index on id, not a primary key (id, slot) on the whole
-- table (a partitioned table's unique index must hold the partitioning column). An index
-- unique on id alone tells the planner that an id is one row: over (id, slot), with no
-- statistics (autovacuum off: never analyzed), it took a prune's list of 1,000 ids for most
-- of the slot and read every slot whole, and bench P sank from 2,900 to 670 jobs/s. Ids come
-- from one sequence, so each is in one slot.
CREATE UNIQUE INDEX tenure_jobs_0_id ON tenure_jobs_0 (id);
CREATE UNIQUE INDEX tenure_jobs_1_id ON tenure_jobs_1 (id);
CREATE UNIQUE INDEX tenure_jobs_2_id ON tenure_jobs_2 (id);
CREATE UNIQUE INDEX tenure_jobs_3_id ON tenure_jobs_3 (id);
CREATE UNIQUE INDEX tenure_jobs_4_id ON tenure_jobs_4 (id);
CREATE UNIQUE INDEX tenure_jobs_5_id ON tenure_jobs_5 (id);
CREATE UNIQUE INDEX tenure_jobs_kept_id ON tenure_jobs_kept (id);
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
    started_at, sequence_key, fair_key, fair_stamp, slot)
SELECT id, queue, kind, payload, priority, state, attempt, max_attempts, due_at,
    created_at, claim_token, claimed_at, claim_expires_at, finished_at, last_error, dedup_key,
    dedup_hits, limit_key, limit_max, lapses, cancel_requested_at, snoozes, dedup_window_micros,
    workflow_id, run_when, stripes_pending, dependents, progress, progress_message, claimed_by,
    started_at, sequence_key, fair_key, fair_stamp, CASE WHEN dedup_key IS NULL THEN 0 ELSE -1 END
FROM tenure_jobs_unsliced;

-- Ids go on from where the old table's left off (never reused: a pruned job's id may still
-- be named elsewhere, in an application's own rows), and whoever had privileges on the old
-- table has them on the new one and on `kept`.
DO $$
DECLARE
    last bigint := GREATEST(
        COALESCE(pg_sequence_last_value(pg_get_serial_sequence('tenure_jobs_unsliced', 'id')::regclass), 0),
        COALESCE((SELECT max(id) FROM tenure_jobs), 0));
    grant_row record;
    target text;
BEGIN
    IF last > 0 THEN
        PERFORM setval(pg_get_serial_sequence('tenure_jobs', 'id'), last, true);
    END IF;
    FOR grant_row IN
        SELECT a.privilege_type, a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'tenure_jobs_unsliced'::regclass AND a.grantee <> c.relowner
    LOOP
        -- The partitions too: keyed jobs are inserted into `kept` by name, a claim's mark, a
        -- finish and a bulk's COPY name the job's slot, and each needs its own grant.
        FOREACH target IN ARRAY ARRAY['tenure_jobs', 'tenure_jobs_kept', 'tenure_jobs_0',
            'tenure_jobs_1', 'tenure_jobs_2', 'tenure_jobs_3', 'tenure_jobs_4', 'tenure_jobs_5'] LOOP
            EXECUTE format('GRANT %s ON %I TO %s%s', grant_row.privilege_type, target,
                CASE WHEN grant_row.grantee = 0 THEN 'PUBLIC'
                     ELSE quote_ident(pg_get_userbyid(grant_row.grantee)) END,
                CASE WHEN grant_row.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END $$;

DROP TABLE tenure_jobs_unsliced;

-- The ready ring's entries carry their job's slot, so that a claim's join reads the job in
-- that slot alone (run-time partition pruning) instead of probing all seven.
ALTER TABLE tenure_ready ADD COLUMN job_slot smallint NOT NULL DEFAULT 0;
UPDATE tenure_ready r SET job_slot = j.slot FROM tenure_jobs j WHERE j.id = r.id;

CREATE OR REPLACE FUNCTION tenure_ready_inserted() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp,
                              fair_key, job_slot)
    SELECT (SELECT last_value % 3 FROM tenure_ready_generation), n.id, n.queue, n.kind,
           n.priority, n.due_at, n.limit_key, n.fair_stamp, n.fair_key, n.slot
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
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, fair_stamp,
                                  fair_key, job_slot)
        SELECT last_value % 3, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at,
               NEW.limit_key, NEW.fair_stamp, NEW.fair_key, NEW.slot
        FROM tenure_ready_generation;
    END IF;
    RETURN NULL;
END $$;

-- The ring's rotation (tenure-0045, tenure-0054) copies the slot with the entry.
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
    EXECUTE format('INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, '
        'fair_stamp, fair_key, job_slot) '
        'SELECT $1, id, queue, kind, priority, due_at, limit_key, fair_stamp, fair_key, job_slot '
        'FROM %I', oldest)
        USING (current_generation % 3)::smallint;
    GET DIAGNOSTICS moved = ROW_COUNT;
    EXECUTE format('TRUNCATE %I', oldest);
    UPDATE tenure_ready_ring SET generation = current_generation + 1,
        rotated_at = statement_timestamp();
    PERFORM setval('tenure_ready_generation', current_generation + 1);
    RETURN moved;
END $$;

-- The ready ring's triggers (tenure-0045), on the new table; inserts into `kept` named
-- directly fire its own statement trigger (a parent's statement triggers fire only for
-- statements that name the parent).
CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION tenure_ready_inserted();
CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs_kept
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION tenure_ready_inserted();
-- A bulk's COPY names the current slot (`copy_in`: through the parent each row's slot default
-- and routing cost a tenth of the bulk's time), so each slot has the trigger too.
DO $$
BEGIN
    FOR n IN 0..5 LOOP
        EXECUTE format('CREATE TRIGGER tenure_ready_inserted AFTER INSERT ON %I '
            'REFERENCING NEW TABLE AS added FOR EACH STATEMENT '
            'EXECUTE FUNCTION tenure_ready_inserted()', 'tenure_jobs_' || n);
    END LOOP;
END $$;
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

-- When the slots last turned (one row; one version a rotation), and the rotations' backoff:
-- how many in a row found an empty slot's lock held past their wait (a transaction that
-- used tenure_jobs and stays open, a report), and when the next may try.
CREATE TABLE tenure_jobs_rotation (
    rotated_at timestamptz NOT NULL,
    failures   integer     NOT NULL DEFAULT 0,
    retry_at   timestamptz
);
INSERT INTO tenure_jobs_rotation (rotated_at) VALUES (statement_timestamp());

-- A rotation (`jobs::rotate_job_slots`), if the last is at least `min_interval_us` old by the
-- database's clock and no backoff holds it: the first slot after the current one that holds
-- no job is truncated and becomes current. Its exclusive lock is asked for NOWAIT when
-- `lock_wait_ms` is 0, else waited for that long at most (every statement on tenure_jobs
-- that arrives meanwhile waits behind it, so never longer; a busy queue rarely leaves a slot
-- unlocked for an instant, so NOWAIT alone was rarely granted). A wait that fails starts or
-- doubles a backoff (100 ms, then twice as long each time, at most a minute): a transaction
-- that stays open holds the lock for its whole length, and a rotation waiting each second
-- would hold claims up for a third of the time (a helper's attack measured it). The slot is
-- checked empty under the lock: no writer can hold a row lock there then, and a slot with a
-- job still in it (waiting, running, kept by retention) is never truncated; nothing moves.
-- Returns the new current slot; -1 when not due, backing off, or another rotation holds the
-- rotation lock ("tenure.j" as a transaction advisory lock); -2 when the slot's lock was not
-- granted (tried again later); -3 when no other slot is empty (retention keeps jobs longer
-- than the slots turn, or a job runs long: new jobs go on filling the current slot).
CREATE FUNCTION tenure_rotate_job_slots(min_interval_us bigint, lock_wait_ms integer)
    RETURNS bigint LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    current_slot integer;
    candidate integer;
    partition text;
    busy boolean;
    lock_timeout_before text := current_setting('lock_timeout');
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
    -- The current slot's statistics, each time it has doubled since the last (16 pages
    -- first). A truncate leaves a slot without any, and a statement planned then (a finish's
    -- lock by id, a generic plan kept for the session) read the slot whole at every run as
    -- it filled: bench P's drain fell from 18,000 to 6,000 jobs a second. An ANALYZE
    -- invalidates those plans; the next are planned with the slot's size (an index scan).
    -- Its lock (SHARE UPDATE EXCLUSIVE) is waited for 20 ms at most: a VACUUM or ANALYZE of
    -- the slot holds it, and a rotation waiting for it held the rotation's lock, and with it
    -- every rotation and reclaim, for as long (the next rotation tries again).
    partition := 'tenure_jobs_' || pg_sequence_last_value('tenure_jobs_slot'::regclass);
    IF pg_relation_size(partition::regclass) > 8192 * GREATEST(16, 2 * (
        SELECT relpages FROM pg_class WHERE oid = partition::regclass)) THEN
        BEGIN
            PERFORM set_config('lock_timeout', '20ms', true);
            EXECUTE format('ANALYZE %I', partition);
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        PERFORM set_config('lock_timeout', lock_timeout_before, true);
    END IF;
    PERFORM 1 FROM tenure_jobs_rotation
    WHERE rotated_at + min_interval_us * interval '1 microsecond' <= statement_timestamp()
      AND (retry_at IS NULL OR retry_at <= statement_timestamp());
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
        BEGIN
            IF lock_wait_ms > 0 THEN
                PERFORM set_config('lock_timeout', lock_wait_ms || 'ms', true);
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', partition);
            ELSE
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', partition);
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            IF lock_wait_ms > 0 THEN
                UPDATE tenure_jobs_rotation SET failures = failures + 1,
                    retry_at = statement_timestamp()
                        + LEAST(interval '100 milliseconds' * power(2, LEAST(failures, 10)),
                                interval '1 minute');
            END IF;
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
        UPDATE tenure_jobs_rotation SET rotated_at = statement_timestamp(), failures = 0,
            retry_at = NULL;
        RETURN candidate;
    END LOOP;
    RETURN -3;
END $$;

-- Retention by slot (`jobs::reclaim_job_slots`): a slot other than the current one whose jobs
-- retention would all delete is truncated as it is, with its jobs' rows in the tables beside
-- tenure_jobs, instead of its jobs being deleted one by one (a dead row version each, walked
-- by every prune until the slot goes; a drain faster than those deletes never empties a slot,
-- and the slots stop turning). A job may go when it is finished, its queue and state have a
-- policy entry (`queues[i]`, `states[i]`) and it finished before `befores[i]` (the caller's
-- cutoffs, read as `jobs::prune` reads them: a job finishing meanwhile is newer, so it can
-- only make this keep more), its dedup window is over, and no unfinished or dead job depends
-- on it (`jobs::prune`'s rules). Checked without the slot's lock, then again under it
-- (ACCESS EXCLUSIVE, as the rotation takes it: no statement reads or writes the slot until
-- this commits, and a dependent's enqueue locks the job it depends on first, so it waits).
-- Returns the slot truncated, a row for each queue of its jobs with how many went; or one row
-- (-1 when another rotation or reclaim runs, -2 when a slot's lock was not granted, -3 when no
-- slot may go). One slot a call: each holds its lock briefly.
CREATE FUNCTION tenure_reclaim_job_slot(queues text[], states text[], befores timestamptz[],
    lock_wait_ms integer) RETURNS TABLE (slot bigint, queue text, jobs bigint) LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    current_slot integer;
    candidate integer;
    partition text;
    held boolean;
    all_go boolean;
    workflows bigint;
    lowest bigint;
    highest bigint;
    beside text;
    -- A job of the slot that may go (`j`).
    may_go constant text := '(j.state IN (''completed'', ''dead'', ''cancelled'') '
        'AND EXISTS (SELECT 1 FROM unnest($1, $2, $3) AS p(queue, state, before) '
        '    WHERE p.queue = j.queue AND p.state = j.state AND j.finished_at < p.before) '
        'AND (j.dedup_window_micros IS NULL OR j.finished_at + j.dedup_window_micros '
        '    * interval ''1 microsecond'' <= statement_timestamp()) '
        'AND (j.dependents = 0 OR NOT EXISTS (SELECT 1 FROM tenure_job_dependencies d '
        '    JOIN tenure_jobs w ON w.id = d.job_id WHERE d.depends_on = j.id '
        '    AND w.state IN (''blocked'', ''waiting'', ''running'', ''parked'', ''dead''))))';
    -- A job of the slot that must stay (%2$s: the newest job alone, or every job).
    holds constant text := 'SELECT EXISTS (SELECT 1 FROM %1$I j WHERE %2$s NOT ' || may_go || ')';
    -- Under the lock: the slot's jobs by queue, and whether all of each queue's may go, in one
    -- read (what a worker reports as pruned).
    by_queue constant text := 'SELECT j.queue::text, count(*), bool_and(' || may_go || ') '
        'FROM %1$I j GROUP BY j.queue';
    queues_seen text[];
    counts bigint[];
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'tenure_reclaim_job_slot needs a READ COMMITTED transaction, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'invalid_transaction_state';
    END IF;
    -- The rotation's lock: one of the two at a time, so the current slot stays current.
    IF NOT pg_try_advisory_xact_lock(8387231331756879466) THEN
        RETURN QUERY SELECT -1::bigint, NULL::text, 0::bigint;
        RETURN;
    END IF;
    current_slot := pg_sequence_last_value('tenure_jobs_slot'::regclass);
    FOR step IN 1..5 LOOP
        candidate := (current_slot + step) % 6;
        partition := 'tenure_jobs_' || candidate;
        -- Nothing written since its last truncate (a truncate again would only churn the
        -- catalog).
        CONTINUE WHEN pg_relation_size(partition::regclass) = 0;
        -- The newest job first (by id: ids rise with the slots): while it is held, the slot
        -- is, and the whole slot is read only once the newest may go.
        EXECUTE format(holds, partition, format('j.id = (SELECT max(id) FROM %I) AND', partition))
            INTO held USING queues, states, befores;
        CONTINUE WHEN held;
        EXECUTE format(holds, partition, '') INTO held USING queues, states, befores;
        CONTINUE WHEN held;
        BEGIN
            IF lock_wait_ms > 0 THEN
                PERFORM set_config('lock_timeout', lock_wait_ms || 'ms', true);
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', partition);
            ELSE
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', partition);
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            RETURN QUERY SELECT -2::bigint, NULL::text, 0::bigint;
            RETURN;
        END;
        -- Under the slot's lock, any other lock (a row of the rows beside its jobs, a workflow)
        -- is waited for briefly, then the reclaim gives up, its lock with it: a finish that
        -- holds a dependency edge of one of the slot's jobs and then reads through the parent
        -- waits for this slot's lock while this waited for its edge, a deadlock of which the
        -- server made the finish the victim after a second (a helper's attack: the caller's
        -- whole transaction failed). A reclaim that gives up is tried again a second later.
        PERFORM set_config('lock_timeout', greatest(lock_wait_ms, 20) || 'ms', true);
        BEGIN
            EXECUTE format('SELECT array_agg(q), array_agg(n), coalesce(bool_and(g), true) '
                'FROM (' || by_queue || ') AS c(q, n, g)', partition)
                INTO queues_seen, counts, all_go USING queues, states, befores;
            IF NOT all_go THEN
                RETURN QUERY SELECT -3::bigint, NULL::text, 0::bigint;
                RETURN;
            END IF;
            -- Their workflows' rows locked first, as `jobs::prune` locks them, and deleted when
            -- no job outside the slot is left in them.
            EXECUTE format('SELECT count(*) FROM (SELECT id FROM tenure_workflows WHERE id IN '
                '(SELECT workflow_id FROM %I) ORDER BY id FOR UPDATE) AS locked', partition) INTO workflows;
            EXECUTE format('DELETE FROM tenure_workflows w WHERE w.id IN (SELECT workflow_id FROM %I) '
                'AND NOT EXISTS (SELECT 1 FROM tenure_jobs j WHERE j.workflow_id = w.id AND j.slot <> $1)',
                partition) USING candidate::smallint;
            -- The rows beside its jobs, by their ids' range (looked for first: most of these
            -- tables hold nothing in it, and a delete joined to the whole slot reads it all).
            EXECUTE format('SELECT min(id), max(id) FROM %I', partition) INTO lowest, highest;
            FOREACH beside IN ARRAY ARRAY['tenure_job_errors:job_id', 'tenure_job_outputs:job_id',
                'tenure_job_limits:job_id', 'tenure_job_results:job_id', 'tenure_parked:job_id',
                'tenure_steps:job_id', 'tenure_dependency_stripes:job_id',
                'tenure_job_dependencies:job_id', 'tenure_job_dependencies:depends_on'] LOOP
                EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE %I BETWEEN $1 AND $2)',
                    split_part(beside, ':', 1), split_part(beside, ':', 2))
                    INTO held USING lowest, highest;
                IF held THEN
                    EXECUTE format('DELETE FROM %I WHERE %I BETWEEN $1 AND $2 AND %I IN (SELECT id FROM %I)',
                        split_part(beside, ':', 1), split_part(beside, ':', 2),
                        split_part(beside, ':', 2), partition) USING lowest, highest;
                END IF;
            END LOOP;
            EXECUTE format('TRUNCATE %I', partition);
            RETURN QUERY SELECT candidate::bigint, c.q, c.n
                FROM unnest(queues_seen, counts) AS c(q, n) WHERE c.q IS NOT NULL;
            -- An empty slot still says which it was.
            IF queues_seen IS NULL THEN
                RETURN QUERY SELECT candidate::bigint, NULL::text, 0::bigint;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            RETURN QUERY SELECT -2::bigint, NULL::text, 0::bigint;
        END;
        RETURN;
    END LOOP;
    RETURN QUERY SELECT -3::bigint, NULL::text, 0::bigint;
END $$;

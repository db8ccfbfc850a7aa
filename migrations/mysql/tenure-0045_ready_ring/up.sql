-- The ready ring (docs/storage-design.md): one entry per waiting job, in three partitions a
-- rotation empties by TRUNCATE PARTITION, so that the delete-marked entries claims leave
-- behind are reclaimed whatever read view another transaction holds open (purge cannot
-- remove them while one is, and tenure_jobs' claim index filled with them: claims walked
-- every job claimed since the oldest read view began, and fell behind). Claims read only this
-- table; triggers on tenure_jobs keep it exact (an entry exists if and only if the job is
-- waiting), so no statement that changes a job can forget it. The primary key leads with
-- the id (every unique key of a partitioned table holds the partitioning column).
CREATE TABLE IF NOT EXISTS tenure_ready (
    slot      TINYINT        NOT NULL,
    id        BIGINT         NOT NULL,
    queue     VARBINARY(255) NOT NULL,
    kind      VARBINARY(255) NOT NULL,
    priority  INT            NOT NULL,
    due_at    DATETIME(6)    NOT NULL,
    limit_key VARBINARY(255) NULL,
    PRIMARY KEY (id, slot),
    INDEX tenure_ready_claim (queue, priority, due_at, id),
    INDEX tenure_ready_claim_kind (queue, kind, priority, due_at, id)
) ENGINE = InnoDB
PARTITION BY LIST (slot) (
    PARTITION p0 VALUES IN (0),
    PARTITION p1 VALUES IN (1),
    PARTITION p2 VALUES IN (2)
);

-- The generation new entries go to (its value modulo 3 is their slot) and the time of the
-- last rotation, which rotations read. One row (a primary key, as Galera requires).
CREATE TABLE IF NOT EXISTS tenure_ready_ring (
    one        TINYINT     NOT NULL PRIMARY KEY,
    generation BIGINT      NOT NULL,
    rotated_at DATETIME(6) NOT NULL
) ENGINE = InnoDB;
INSERT IGNORE INTO tenure_ready_ring (one, generation, rotated_at) VALUES (1, 0, UTC_TIMESTAMP(6));

-- A job enters the ring when it starts waiting, leaves it when it stops (a claim included:
-- unlike PostgreSQL's, whose claim deletes its entries in its own statement, MariaDB's row
-- triggers fire per row anyway), and moves when what claims read of it changes while it
-- waits (a replacing duplicate). The slot is read without a lock: a transaction with an old
-- read view may put its entry in an older slot, which is harmless (a rotation moves every
-- entry still in the slot it empties, under a lock no open writer of the ring can hold).
CREATE OR REPLACE TRIGGER tenure_ready_inserted AFTER INSERT ON tenure_jobs FOR EACH ROW
BEGIN
    DECLARE ring_slot TINYINT;
    IF NEW.state = 'waiting' THEN
        SELECT generation % 3 INTO ring_slot FROM tenure_ready_ring WHERE one = 1;
        INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
        VALUES (ring_slot, NEW.id, NEW.queue, NEW.kind, NEW.priority, NEW.due_at, NEW.limit_key);
    END IF;
END;

CREATE OR REPLACE TRIGGER tenure_ready_updated AFTER UPDATE ON tenure_jobs FOR EACH ROW
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

CREATE OR REPLACE TRIGGER tenure_ready_deleted AFTER DELETE ON tenure_jobs FOR EACH ROW
BEGIN
    IF OLD.state = 'waiting' THEN
        DELETE FROM tenure_ready WHERE id = OLD.id;
    END IF;
END;

-- Claims of some kinds read the ring's kind index now; tenure_jobs_claim stays for the
-- readers of a queue's jobs by state (queue_depth, admission's running jobs).
DROP INDEX IF EXISTS tenure_jobs_claim_kind ON tenure_jobs;

-- The jobs waiting now enter the ring, those an enqueue's trigger or a rotation (which
-- takes no migration lock) put in some slot meanwhile excepted.
INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key)
SELECT 0, j.id, j.queue, j.kind, j.priority, j.due_at, j.limit_key FROM tenure_jobs j
WHERE j.state = 'waiting' AND NOT EXISTS (SELECT 1 FROM tenure_ready r WHERE r.id = j.id);

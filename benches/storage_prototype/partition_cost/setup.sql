-- The per-statement cost of a partitioned jobs table (docs/storage-design.md, "What the
-- partition costs a statement"): `plain`, one table with tenure_jobs' indexes, and `parted`,
-- the same rows in six slots and kept (LIST on slot, each with its own unique index on id),
-- as job_slots.patch lays tenure_jobs out. 60,000 running jobs, 10,000 a slot.
DROP TABLE IF EXISTS plain, parted;
CREATE TABLE plain (
    id bigint PRIMARY KEY, queue text NOT NULL, kind text NOT NULL, payload bytea NOT NULL,
    priority int NOT NULL DEFAULT 0, state text NOT NULL, attempt int NOT NULL DEFAULT 0,
    due_at timestamptz NOT NULL, claim_expires_at timestamptz, finished_at timestamptz,
    limit_key text, workflow_id bigint, slot smallint NOT NULL);
CREATE INDEX ON plain (queue, state);
CREATE INDEX ON plain (claim_expires_at) WHERE state = 'running';
CREATE INDEX ON plain (limit_key) WHERE state = 'running' AND limit_key IS NOT NULL;
CREATE INDEX ON plain (queue, state, finished_at, id) WHERE state IN ('completed', 'dead', 'cancelled');
CREATE INDEX ON plain (workflow_id, state) WHERE workflow_id IS NOT NULL;
INSERT INTO plain SELECT g, 'q', 'k', '\x', 0, 'running', 1, now(), now(), NULL, NULL, NULL,
    (g % 6)::smallint FROM generate_series(1, 60000) g;
CREATE TABLE parted (LIKE plain INCLUDING DEFAULTS) PARTITION BY LIST (slot);
CREATE TABLE parted_kept PARTITION OF parted FOR VALUES IN (-1);
CREATE TABLE parted_0 PARTITION OF parted FOR VALUES IN (0);
CREATE TABLE parted_1 PARTITION OF parted FOR VALUES IN (1);
CREATE TABLE parted_2 PARTITION OF parted FOR VALUES IN (2);
CREATE TABLE parted_3 PARTITION OF parted FOR VALUES IN (3);
CREATE TABLE parted_4 PARTITION OF parted FOR VALUES IN (4);
CREATE TABLE parted_5 PARTITION OF parted FOR VALUES IN (5);
CREATE UNIQUE INDEX ON parted_kept (id);
CREATE UNIQUE INDEX ON parted_0 (id);
CREATE UNIQUE INDEX ON parted_1 (id);
CREATE UNIQUE INDEX ON parted_2 (id);
CREATE UNIQUE INDEX ON parted_3 (id);
CREATE UNIQUE INDEX ON parted_4 (id);
CREATE UNIQUE INDEX ON parted_5 (id);
CREATE INDEX ON parted (queue, state);
CREATE INDEX ON parted (claim_expires_at) WHERE state = 'running';
CREATE INDEX ON parted (limit_key) WHERE state = 'running' AND limit_key IS NOT NULL;
CREATE INDEX ON parted (queue, state, finished_at, id) WHERE state IN ('completed', 'dead', 'cancelled');
CREATE INDEX ON parted (workflow_id, state) WHERE workflow_id IS NOT NULL;
INSERT INTO parted SELECT * FROM plain;
ANALYZE plain;
ANALYZE parted;

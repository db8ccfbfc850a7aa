DROP TABLE IF EXISTS a_jobs, b_jobs, b_ready, b_gen CASCADE;
-- A: today's shape: one row per job, claimed and finished in place, pruned by DELETE.
CREATE TABLE a_jobs (id bigserial PRIMARY KEY, queue text NOT NULL, state text NOT NULL,
  priority int NOT NULL DEFAULT 0, due_at timestamptz NOT NULL DEFAULT now(),
  payload bytea, finished_at timestamptz);
CREATE INDEX a_claim ON a_jobs (queue, priority, due_at, id) WHERE state = 'waiting';
CREATE INDEX a_done ON a_jobs (finished_at) WHERE state = 'completed';
-- B: the record (never scanned by claims) and a ring of ready entries, reclaimed by TRUNCATE.
CREATE TABLE b_jobs (id bigserial PRIMARY KEY, queue text NOT NULL, state text NOT NULL,
  payload bytea, finished_at timestamptz);
CREATE TABLE b_ready (gen int NOT NULL, queue text NOT NULL, priority int NOT NULL,
  due_at timestamptz NOT NULL, id bigint NOT NULL) PARTITION BY LIST (gen);
CREATE TABLE b_ready_0 PARTITION OF b_ready FOR VALUES IN (0);
CREATE TABLE b_ready_1 PARTITION OF b_ready FOR VALUES IN (1);
CREATE TABLE b_ready_2 PARTITION OF b_ready FOR VALUES IN (2);
CREATE INDEX b_claim ON b_ready (queue, priority, due_at, id);
CREATE TABLE b_gen (one int PRIMARY KEY, cur int NOT NULL);
INSERT INTO b_gen VALUES (1, 0);

-- Jobs. AUTOINCREMENT: ids are never reused after pruning. Instants are TEXT in one layout.
-- state: waiting (due now or later, including retries), running (claimed), completed, dead.
CREATE TABLE tenure_jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    queue            TEXT    NOT NULL,
    kind             TEXT    NOT NULL,
    payload          BLOB    NOT NULL,
    priority         INTEGER NOT NULL DEFAULT 0,
    state            TEXT    NOT NULL,
    attempt          INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    due_at           TEXT    NOT NULL,
    created_at       TEXT    NOT NULL,
    claim_token      BLOB,
    claimed_at       TEXT,
    claim_expires_at TEXT,
    finished_at      TEXT,
    last_error       TEXT
);
-- Serves the claim's filter and order; finished jobs are not in it.
CREATE INDEX tenure_jobs_claim ON tenure_jobs (queue, priority, due_at, id) WHERE state = 'waiting';
CREATE INDEX tenure_jobs_stalled ON tenure_jobs (claim_expires_at) WHERE state = 'running';

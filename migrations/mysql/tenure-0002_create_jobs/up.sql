-- Jobs, in one DDL statement (MySQL commits DDL implicitly). Names are VARBINARY (byte-exact).
-- state: waiting (due now or later, including retries), running (claimed), completed, dead.
-- No partial indexes here: state leads nothing but follows queue, so the claim's
-- `queue = ? AND state = 'waiting' ORDER BY priority, due_at, id` is one index range, read in
-- order; InnoDB then locks only the rows it returns (READ COMMITTED, SKIP LOCKED).
CREATE TABLE IF NOT EXISTS tenure_jobs (
    id               BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    queue            VARBINARY(255) NOT NULL,
    kind             VARBINARY(255) NOT NULL,
    payload          LONGBLOB       NOT NULL,
    priority         INT            NOT NULL DEFAULT 0,
    state            VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    attempt          INT            NOT NULL DEFAULT 0,
    max_attempts     INT            NOT NULL,
    due_at           DATETIME(6)    NOT NULL,
    created_at       DATETIME(6)    NOT NULL,
    claim_token      BINARY(16)     NULL,
    claimed_at       DATETIME(6)    NULL,
    claim_expires_at DATETIME(6)    NULL,
    finished_at      DATETIME(6)    NULL,
    last_error       TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    INDEX tenure_jobs_claim (queue, state, priority, due_at, id),
    INDEX tenure_jobs_stalled (state, claim_expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

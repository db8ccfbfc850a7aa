-- Leases: one row per name, never deleted by tenure, so fences never go back.
-- One DDL statement per migration: MySQL commits DDL implicitly.
-- VARBINARY name: byte-exact ("Job", "job" and "job " differ; the default collations would
-- fold case and ignore trailing spaces). DATETIME(6) holds UTC with microseconds.
CREATE TABLE IF NOT EXISTS tenure_leases (
    name        VARBINARY(255) NOT NULL PRIMARY KEY,
    token       BINARY(16)     NULL,
    holder      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT '',
    fence       BIGINT         NOT NULL,
    acquired_at DATETIME(6)    NOT NULL,
    expires_at  DATETIME(6)    NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Running workers (see the PostgreSQL migration tenure-0040 for what each column means). One
-- DDL statement (MySQL commits DDL implicitly). A worker holds the named lock
-- GET_LOCK(CONCAT('tenure.worker.', MD5(DATABASE()), '.', id), 0) on a connection it keeps for
-- its life (lock names are server-wide: the database's digest keeps two databases apart).
CREATE TABLE IF NOT EXISTS tenure_workers (
    id              BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    host            VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    pid             BIGINT       NOT NULL,
    started_at      DATETIME(6)  NOT NULL,
    heartbeat_at    DATETIME(6)  NOT NULL,
    lock_free_since DATETIME(6)  NULL
) ENGINE = InnoDB;

-- The error of every failed run of a job (bounded: the newest 20 per job, 4 KiB each).
CREATE TABLE IF NOT EXISTS tenure_job_errors (
    id        BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
    job_id    BIGINT      NOT NULL,
    attempt   INT         NOT NULL,
    error     TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    failed_at DATETIME(6) NOT NULL,
    INDEX tenure_job_errors_job (job_id, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

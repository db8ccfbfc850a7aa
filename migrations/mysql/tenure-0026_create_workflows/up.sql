-- A workflow (or batch): its name and its callback jobs.
CREATE TABLE IF NOT EXISTS tenure_workflows (
    id         BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    name       VARBINARY(255) NOT NULL,
    created_at DATETIME(6)    NOT NULL,
    on_success BIGINT         NULL,
    on_failure BIGINT         NULL,
    on_finish  BIGINT         NULL
) ENGINE = InnoDB;

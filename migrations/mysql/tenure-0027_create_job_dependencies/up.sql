-- job_id waits for depends_on; stripe: the stripe of job_id it counts in; counted: 1 once
-- counted down; run_when: job_id's (see the PostgreSQL migration tenure-0025).
CREATE TABLE IF NOT EXISTS tenure_job_dependencies (
    job_id         BIGINT NOT NULL,
    depends_on     BIGINT NOT NULL,
    stripe         INT    NOT NULL,
    counted        INT    NOT NULL DEFAULT 0,
    run_when       VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    PRIMARY KEY (job_id, depends_on),
    INDEX tenure_job_dependencies_depends_on (depends_on)
) ENGINE = InnoDB;

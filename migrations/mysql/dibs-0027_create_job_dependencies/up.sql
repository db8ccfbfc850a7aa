-- job_id waits for depends_on; pending_stripe: the stripe of job_id the edge still counts in,
-- NULL once counted.
CREATE TABLE IF NOT EXISTS dibs_job_dependencies (
    job_id         BIGINT NOT NULL,
    depends_on     BIGINT NOT NULL,
    pending_stripe INT    NULL,
    PRIMARY KEY (job_id, depends_on),
    INDEX dibs_job_dependencies_depends_on (depends_on)
) ENGINE = InnoDB;

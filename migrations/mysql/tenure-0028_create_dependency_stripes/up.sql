-- A blocked job's pending dependencies, spread over stripes (see the PostgreSQL migration).
CREATE TABLE IF NOT EXISTS tenure_dependency_stripes (
    job_id  BIGINT NOT NULL,
    stripe  INT    NOT NULL,
    pending INT    NOT NULL,
    PRIMARY KEY (job_id, stripe)
) ENGINE = InnoDB;

-- The result a completed job's handler returned; deleted with the job.
CREATE TABLE IF NOT EXISTS tenure_job_results (
    job_id BIGINT      NOT NULL PRIMARY KEY,
    format VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    body   MEDIUMBLOB  NOT NULL
) ENGINE = InnoDB;

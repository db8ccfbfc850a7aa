-- What a run printed and how it exited, for jobs whose runs report it (the `tenure work`
-- command's shell jobs). Bounded by the writer (64 KiB a run); deleted with the job.
CREATE TABLE IF NOT EXISTS tenure_job_outputs (
    id          BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
    job_id      BIGINT      NOT NULL,
    attempt     INT         NOT NULL,
    exit_code   INT         NULL,
    output      MEDIUMBLOB  NOT NULL,
    finished_at DATETIME(6) NOT NULL,
    INDEX tenure_job_outputs_job (job_id, id)
) ENGINE = InnoDB;

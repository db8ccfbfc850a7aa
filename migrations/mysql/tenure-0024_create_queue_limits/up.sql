-- A queue-wide concurrency limit: at most max_running running jobs of the queue. Claimers of
-- a limited queue serialize on its row.
CREATE TABLE IF NOT EXISTS tenure_queue_limits (
    queue       VARBINARY(255) NOT NULL PRIMARY KEY,
    max_running INT            NOT NULL
) ENGINE = InnoDB;

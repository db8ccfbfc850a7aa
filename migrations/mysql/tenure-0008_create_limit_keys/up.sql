-- Claimers of a limit key serialize on its row here (an upsert takes its lock).
CREATE TABLE IF NOT EXISTS tenure_limit_keys (
    limit_key VARBINARY(255) NOT NULL PRIMARY KEY
) ENGINE = InnoDB;

DROP TABLE IF EXISTS tenure_limit_keys;

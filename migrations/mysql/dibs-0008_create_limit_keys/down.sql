DROP TABLE IF EXISTS dibs_limit_keys;

DROP TABLE dibs_limit_starts;

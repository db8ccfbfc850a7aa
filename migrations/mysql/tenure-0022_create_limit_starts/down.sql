DROP TABLE tenure_limit_starts;

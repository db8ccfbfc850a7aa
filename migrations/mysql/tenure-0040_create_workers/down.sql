DROP TABLE tenure_workers;

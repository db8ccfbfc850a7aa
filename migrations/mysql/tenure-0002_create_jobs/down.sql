DROP TABLE IF EXISTS tenure_jobs;

DROP TABLE tenure_jobs;

DROP TABLE tenure_job_limits;

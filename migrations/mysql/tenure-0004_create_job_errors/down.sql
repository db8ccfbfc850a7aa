DROP TABLE IF EXISTS tenure_job_errors;

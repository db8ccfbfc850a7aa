DROP TABLE tenure_job_errors;

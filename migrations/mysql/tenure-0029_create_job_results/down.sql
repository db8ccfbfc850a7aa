DROP TABLE tenure_job_results;

DROP TABLE tenure_job_dependencies;

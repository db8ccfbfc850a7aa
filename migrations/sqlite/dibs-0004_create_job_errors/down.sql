DROP TABLE dibs_job_errors;

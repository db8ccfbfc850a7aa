DROP TABLE dibs_job_results;

DROP TABLE dibs_job_dependencies;

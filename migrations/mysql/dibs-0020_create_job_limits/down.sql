DROP TABLE dibs_job_limits;

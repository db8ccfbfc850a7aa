DROP TABLE IF EXISTS dibs_job_outputs;

DROP TABLE dibs_jobs;

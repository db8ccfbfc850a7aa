DELETE FROM dibs_job_limits;

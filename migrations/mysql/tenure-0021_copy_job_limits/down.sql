DELETE FROM tenure_job_limits;

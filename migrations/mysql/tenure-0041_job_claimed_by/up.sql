-- claimed_by: the worker (tenure_workers) whose claim the job is running under; NULL for a
-- claim made outside a worker. No index: the rescue of a dead worker's claims reads the
-- running jobs (tenure_jobs_stalled), which are few.
ALTER TABLE tenure_jobs ADD COLUMN IF NOT EXISTS claimed_by BIGINT NULL;

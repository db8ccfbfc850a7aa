ALTER TABLE tenure_queue_limits DROP COLUMN IF EXISTS admissions;
ALTER TABLE tenure_limit_keys DROP COLUMN IF EXISTS admissions;

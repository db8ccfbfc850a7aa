-- started_at: when the current claim's run began, where that is recorded: at the claim for
-- a claim made outside a worker (its caller runs it), and by a worker before it runs a job
-- whose claims lapsed before (a suspect). A lapse counts against a job (lapses, dead at
-- tenure's MAX_LAPSES) the first time, and then only for a run that began: jobs a crashing
-- worker claimed ahead never started and are not charged its crashes.
ALTER TABLE tenure_jobs ADD COLUMN IF NOT EXISTS started_at DATETIME(6) NULL;

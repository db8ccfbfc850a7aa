-- snoozes: how often the job's runs were snoozed (put back for later without using an
-- attempt); past tenure's MAX_FREE_SNOOZES a snooze uses an attempt.
-- tenure_jobs_claim_kind serves a claim of some kinds: one kind is one range of it, read (and
-- locked) in claim order (priority, due_at, id), however many waiting jobs of other kinds sit
-- ahead of them in the queue (those are never read). The claim index stays for claims of any
-- kind. One DDL statement (MySQL commits DDL implicitly).
ALTER TABLE tenure_jobs
    ADD COLUMN IF NOT EXISTS snoozes INT NOT NULL DEFAULT 0,
    ADD INDEX IF NOT EXISTS tenure_jobs_claim_kind (queue, state, kind, priority, due_at, id);

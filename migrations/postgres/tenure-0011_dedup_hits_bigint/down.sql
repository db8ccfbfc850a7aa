ALTER TABLE tenure_jobs ALTER COLUMN dedup_hits TYPE integer
    USING LEAST(dedup_hits, 2147483647)::integer;

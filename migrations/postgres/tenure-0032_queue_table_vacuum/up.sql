-- Every row of tenure_jobs turns over: a job is inserted, updated when claimed and when it
-- finishes, and deleted by retention, three dead row versions a job. The default trigger
-- (a fifth of the table dead) lets a small, busy table carry many times its live rows in
-- dead versions, which every claim's index scan walks. Vacuum it after a fixed number of
-- dead versions instead, whatever its size, and throttle that vacuum less.
ALTER TABLE tenure_jobs SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 1,
    autovacuum_analyze_scale_factor = 0.05
);

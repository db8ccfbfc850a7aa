DROP TABLE tenure_lease_waiters;
DROP TABLE tenure_lease_names;
DELETE FROM tenure_leases WHERE slot <> 0;
ALTER TABLE tenure_leases
    DROP CONSTRAINT tenure_leases_pkey,
    ADD PRIMARY KEY (name),
    DROP COLUMN slot,
    DROP COLUMN reusable_at,
    DROP COLUMN lock_delay_us,
    DROP COLUMN value,
    DROP COLUMN held_by;

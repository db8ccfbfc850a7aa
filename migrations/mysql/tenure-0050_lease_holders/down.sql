DROP TABLE IF EXISTS tenure_lease_waiters;
DROP TABLE IF EXISTS tenure_lease_names;
DELETE FROM tenure_leases WHERE slot <> 0;
ALTER TABLE tenure_leases
    DROP PRIMARY KEY,
    ADD PRIMARY KEY (name),
    DROP COLUMN IF EXISTS slot,
    DROP COLUMN IF EXISTS reusable_at,
    DROP COLUMN IF EXISTS lock_delay_us,
    DROP COLUMN IF EXISTS value,
    DROP COLUMN IF EXISTS held_by;

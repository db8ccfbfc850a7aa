-- Slot 0 keeps the name's last fence, so that fences do not go back after the rollback;
-- the holders of other slots are dropped (the old schema has one holder a name).
UPDATE tenure_leases l JOIN tenure_lease_names n ON n.name = l.name
    SET l.fence = n.fence WHERE l.slot = 0;
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

-- Slot 0 keeps the name's last fence, so that fences do not go back after the rollback;
-- the holders of other slots are dropped (the old schema has one holder a name).
UPDATE tenure_leases SET fence = n.fence FROM tenure_lease_names n
    WHERE n.name = tenure_leases.name AND tenure_leases.slot = 0;
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

-- Slot 0 keeps the name's last fence, so that fences do not go back after the rollback;
-- the holders of other slots are dropped (the old schema has one holder a name).
UPDATE tenure_leases SET fence = (SELECT n.fence FROM tenure_lease_names n WHERE n.name = tenure_leases.name)
    WHERE slot = 0 AND name IN (SELECT name FROM tenure_lease_names);
DROP TABLE tenure_lease_waiters;
DROP TABLE tenure_lease_names;
CREATE TABLE tenure_leases_one (
    name        TEXT    NOT NULL PRIMARY KEY,
    token       BLOB,
    holder      TEXT    NOT NULL DEFAULT '',
    fence       INTEGER NOT NULL,
    acquired_at TEXT    NOT NULL,
    expires_at  TEXT    NOT NULL
);
INSERT INTO tenure_leases_one (name, token, holder, fence, acquired_at, expires_at)
    SELECT name, token, holder, fence, acquired_at, expires_at FROM tenure_leases WHERE slot = 0;
DROP TABLE tenure_leases;
ALTER TABLE tenure_leases_one RENAME TO tenure_leases;

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

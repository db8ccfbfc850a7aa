-- Leases of N holders (docs/leases.md). tenure_leases becomes one row per holder slot of a
-- name (slot 0 .. N-1; a lease of one holder has only slot 0, as before), and the name's own
-- state moves to tenure_lease_names: how many holders it has, the last fence granted (fences
-- grow per name, whichever slot a grant takes) and the next waiter's ticket.
--   reusable_at: when the slot may be granted again: the release time after a release, the
--     expiry plus the holder's lock delay while held or lapsed, the force-release time plus
--     that delay after a force release.
--   lock_delay_us: the delay the holder asked for, in microseconds (0: none).
--   value: what the holder published with its grant (cleared at each grant).
--   held_by: reserved for the registration of the holder's process (NULL: none).
-- SQLite cannot change a primary key in place: the table is made again.
CREATE TABLE tenure_leases_slots (
    name          TEXT    NOT NULL,
    slot          INTEGER NOT NULL DEFAULT 0,
    token         BLOB,
    holder        TEXT    NOT NULL DEFAULT '',
    fence         INTEGER NOT NULL,
    acquired_at   TEXT    NOT NULL,
    expires_at    TEXT    NOT NULL,
    reusable_at   TEXT    NOT NULL,
    lock_delay_us INTEGER NOT NULL DEFAULT 0,
    value         TEXT,
    held_by       INTEGER,
    PRIMARY KEY (name, slot)
);
INSERT INTO tenure_leases_slots (name, slot, token, holder, fence, acquired_at, expires_at, reusable_at)
    SELECT name, 0, token, holder, fence, acquired_at, expires_at, expires_at FROM tenure_leases;
DROP TABLE tenure_leases;
ALTER TABLE tenure_leases_slots RENAME TO tenure_leases;

-- One row per lease name, never deleted by tenure, so fences never go back.
CREATE TABLE tenure_lease_names (
    name        TEXT    NOT NULL PRIMARY KEY,
    holders     INTEGER NOT NULL,
    fence       INTEGER NOT NULL,
    next_ticket INTEGER NOT NULL
);
INSERT INTO tenure_lease_names (name, holders, fence, next_ticket)
    SELECT name, 1, fence, 1 FROM tenure_leases;

-- Callers waiting for a lease, served in ticket order. A waiter renews its place while it
-- waits; a place not renewed by expires_at is gone (its waiter gave up or died).
CREATE TABLE tenure_lease_waiters (
    name       TEXT    NOT NULL,
    ticket     INTEGER NOT NULL,
    holder     TEXT    NOT NULL,
    joined_at  TEXT    NOT NULL,
    expires_at TEXT    NOT NULL,
    PRIMARY KEY (name, ticket)
);

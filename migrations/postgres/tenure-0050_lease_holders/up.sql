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
ALTER TABLE tenure_leases
    ADD COLUMN slot integer NOT NULL DEFAULT 0,
    ADD COLUMN reusable_at timestamptz,
    ADD COLUMN lock_delay_us bigint NOT NULL DEFAULT 0,
    ADD COLUMN value text,
    ADD COLUMN held_by bigint;
UPDATE tenure_leases SET reusable_at = expires_at;
ALTER TABLE tenure_leases
    ALTER COLUMN reusable_at SET NOT NULL,
    DROP CONSTRAINT tenure_leases_pkey,
    ADD PRIMARY KEY (name, slot);

-- One row per lease name, never deleted by tenure, so fences never go back. Every grant
-- locks it: grants of one name take turns.
CREATE TABLE tenure_lease_names (
    name        text COLLATE "C" NOT NULL PRIMARY KEY,
    holders     integer NOT NULL,
    fence       bigint  NOT NULL,
    next_ticket bigint  NOT NULL
);
INSERT INTO tenure_lease_names (name, holders, fence, next_ticket)
    SELECT name, 1, fence, 1 FROM tenure_leases;

-- Callers waiting for a lease, served in ticket order. A waiter renews its place while it
-- waits; a place not renewed by expires_at is gone (its waiter gave up or died).
CREATE TABLE tenure_lease_waiters (
    name       text COLLATE "C" NOT NULL,
    ticket     bigint      NOT NULL,
    holder     text        NOT NULL,
    joined_at  timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, ticket)
);

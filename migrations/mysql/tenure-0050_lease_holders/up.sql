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
-- Every statement can run again: MySQL commits DDL implicitly, so a migration cut short
-- runs again from its start.
ALTER TABLE tenure_leases
    ADD COLUMN IF NOT EXISTS slot INT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reusable_at DATETIME(6) NULL,
    ADD COLUMN IF NOT EXISTS lock_delay_us BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS value TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    ADD COLUMN IF NOT EXISTS held_by BIGINT NULL,
    DROP PRIMARY KEY,
    ADD PRIMARY KEY (name, slot);
UPDATE tenure_leases SET reusable_at = expires_at WHERE reusable_at IS NULL;
ALTER TABLE tenure_leases MODIFY reusable_at DATETIME(6) NOT NULL;

-- One row per lease name, never deleted by tenure, so fences never go back. Every grant
-- locks it: grants of one name take turns.
CREATE TABLE IF NOT EXISTS tenure_lease_names (
    name        VARBINARY(255) NOT NULL PRIMARY KEY,
    holders     INT            NOT NULL,
    fence       BIGINT         NOT NULL,
    next_ticket BIGINT         NOT NULL
) ENGINE = InnoDB;
INSERT INTO tenure_lease_names (name, holders, fence, next_ticket)
    SELECT name, 1, MAX(fence), 1 FROM tenure_leases GROUP BY name
    ON DUPLICATE KEY UPDATE fence = GREATEST(tenure_lease_names.fence, VALUES(fence));

-- Callers waiting for a lease, served in ticket order. A waiter renews its place while it
-- waits; a place not renewed by expires_at is gone (its waiter gave up or died).
CREATE TABLE IF NOT EXISTS tenure_lease_waiters (
    name       VARBINARY(255) NOT NULL,
    ticket     BIGINT         NOT NULL,
    holder     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    joined_at  DATETIME(6)    NOT NULL,
    expires_at DATETIME(6)    NOT NULL,
    PRIMARY KEY (name, ticket)
) ENGINE = InnoDB;

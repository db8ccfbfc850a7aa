-- Leases: one row per name, never deleted by tenure, so fences never go back.
-- COLLATE "C": names compare and sort byte for byte.
CREATE TABLE tenure_leases (
    name        text COLLATE "C" NOT NULL PRIMARY KEY,
    token       uuid,
    holder      text        NOT NULL DEFAULT '',
    fence       bigint      NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);

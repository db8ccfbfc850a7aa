-- Leases: one row per name, never deleted by tenure, so fences never go back.
-- Names compare byte for byte (BINARY collation); instants are TEXT 'YYYY-MM-DD HH:MM:SS.SSS'.
CREATE TABLE tenure_leases (
    name        TEXT    NOT NULL PRIMARY KEY,
    token       BLOB,
    holder      TEXT    NOT NULL DEFAULT '',
    fence       INTEGER NOT NULL,
    acquired_at TEXT    NOT NULL,
    expires_at  TEXT    NOT NULL
);

-- dedup_hits: SQLite's INTEGER already holds 64 bits, so the column needs no change; tenure
-- read it as a 32-bit value, which made the 2^31-th duplicate look like a new job (fixed
-- in the code, which now reads 64 bits). This step only keeps the migration numbers in
-- step with the other backends.
SELECT 1;

WITH j AS (INSERT INTO b_jobs (queue, state, payload) VALUES ('q', 'waiting', '\x00') RETURNING id) INSERT INTO b_ready SELECT (SELECT cur FROM b_gen WHERE one = 1), 'q', 0, now(), id FROM j;

INSERT INTO a_jobs (queue, state, payload) VALUES ('q', 'waiting', '\x00');

-- The storage prototype on MariaDB: the same two layouts as ../setup.sql, driven by stored
-- procedures (one session each), latencies logged into an Aria table (not InnoDB: a held
-- read view does not touch it).
DROP TABLE IF EXISTS a_jobs, b_jobs, b_ready, b_gen, lat, sizes;
CREATE TABLE a_jobs (id BIGINT AUTO_INCREMENT PRIMARY KEY, queue VARCHAR(64) NOT NULL,
  state VARCHAR(16) NOT NULL, priority INT NOT NULL DEFAULT 0,
  due_at DATETIME(6) NOT NULL DEFAULT NOW(6), payload BLOB, finished_at DATETIME(6),
  KEY a_claim (queue, state, priority, due_at, id), KEY a_done (state, finished_at)) ENGINE=InnoDB;
CREATE TABLE b_jobs (id BIGINT AUTO_INCREMENT PRIMARY KEY, queue VARCHAR(64) NOT NULL,
  state VARCHAR(16) NOT NULL, payload BLOB, finished_at DATETIME(6),
  KEY b_done (state, finished_at)) ENGINE=InnoDB;
CREATE TABLE b_ready (gen INT NOT NULL, queue VARCHAR(64) NOT NULL, priority INT NOT NULL,
  due_at DATETIME(6) NOT NULL, id BIGINT NOT NULL, PRIMARY KEY (gen, id),
  KEY b_claim (queue, priority, due_at, id)) ENGINE=InnoDB
  PARTITION BY LIST (gen) (PARTITION p0 VALUES IN (0), PARTITION p1 VALUES IN (1), PARTITION p2 VALUES IN (2));
CREATE TABLE b_gen (one INT PRIMARY KEY, cur INT NOT NULL) ENGINE=InnoDB;
INSERT INTO b_gen VALUES (1, 0);
CREATE TABLE lat (layout CHAR(1), at DATETIME(6), us BIGINT) ENGINE=Aria;
CREATE TABLE sizes (layout CHAR(1), at DATETIME(6), claim_bytes BIGINT, record_bytes BIGINT, history BIGINT) ENGINE=Aria;

DROP PROCEDURE IF EXISTS produce;
DROP PROCEDURE IF EXISTS consume;
DROP PROCEDURE IF EXISTS maintain;
DELIMITER //
-- 500 jobs a second: 5 every 10 ms, paced by the clock.
CREATE PROCEDURE produce(layout CHAR(1), secs INT)
BEGIN
  DECLARE stop DATETIME(6) DEFAULT NOW(6) + INTERVAL secs SECOND;
  DECLARE i INT;
  WHILE NOW(6) < stop DO
    SET i = 0;
    WHILE i < 5 DO
      -- A deadlock (with the rotation, on b_gen's row) rolls back that enqueue, as a
      -- client would, and the loop goes on.
      BEGIN
        DECLARE EXIT HANDLER FOR SQLEXCEPTION ROLLBACK;
        IF layout = 'a' THEN
          INSERT INTO a_jobs (queue, state, payload) VALUES ('q', 'waiting', 'x');
        ELSE
          START TRANSACTION;
          INSERT INTO b_jobs (queue, state, payload) VALUES ('q', 'waiting', 'x');
          INSERT INTO b_ready SELECT cur, 'q', 0, NOW(6), LAST_INSERT_ID() FROM b_gen WHERE one = 1;
          COMMIT;
        END IF;
      END;
      SET i = i + 1;
    END WHILE;
    DO SLEEP(0.01);
  END WHILE;
END //
-- A claim of up to 10 every 20 ms (two sessions: 100 claims a second), its time logged.
CREATE PROCEDURE consume(layout CHAR(1), secs INT)
BEGIN
  DECLARE stop DATETIME(6) DEFAULT NOW(6) + INTERVAL secs SECOND;
  DECLARE t0 DATETIME(6);
  CREATE TEMPORARY TABLE IF NOT EXISTS picked (id BIGINT PRIMARY KEY, gen INT) ENGINE=MEMORY;
  WHILE NOW(6) < stop DO
    SET t0 = NOW(6);
    -- A deadlock victim rolls back and claims again at its next turn (logged all the same).
    BEGIN
      DECLARE EXIT HANDLER FOR SQLEXCEPTION ROLLBACK;
      START TRANSACTION;
      DELETE FROM picked;
      IF layout = 'a' THEN
        INSERT INTO picked (id) SELECT id FROM a_jobs WHERE queue = 'q' AND state = 'waiting'
          AND due_at <= NOW(6) ORDER BY priority, due_at, id LIMIT 10 FOR UPDATE SKIP LOCKED;
        UPDATE a_jobs JOIN picked USING (id) SET state = 'completed', finished_at = NOW(6);
      ELSE
        INSERT INTO picked (id, gen) SELECT id, gen FROM b_ready WHERE queue = 'q'
          AND due_at <= NOW(6) ORDER BY priority, due_at, id LIMIT 10 FOR UPDATE SKIP LOCKED;
        DELETE b_ready FROM b_ready JOIN picked ON b_ready.gen = picked.gen AND b_ready.id = picked.id;
        UPDATE b_jobs JOIN picked USING (id) SET state = 'completed', finished_at = NOW(6);
      END IF;
      COMMIT;
    END;
    INSERT INTO lat VALUES (layout, t0, TIMESTAMPDIFF(MICROSECOND, t0, NOW(6)));
    DO SLEEP(GREATEST(0, 0.02 - TIMESTAMPDIFF(MICROSECOND, t0, NOW(6)) / 1e6));
  END WHILE;
END //
-- Each second: A prunes; B rotates its ring and truncates the generation two behind when it
-- is empty (lock_wait_timeout 1 s), and prunes its records; both sample sizes and the
-- history list (undo not yet purged).
CREATE PROCEDURE maintain(layout CHAR(1), secs INT)
BEGIN
  DECLARE stop DATETIME(6) DEFAULT NOW(6) + INTERVAL secs SECOND;
  DECLARE old INT;
  DECLARE n INT;
  DECLARE CONTINUE HANDLER FOR SQLEXCEPTION BEGIN END;
  SET SESSION lock_wait_timeout = 1;
  WHILE NOW(6) < stop DO
    IF layout = 'a' THEN
      DELETE FROM a_jobs WHERE state = 'completed' AND finished_at < NOW(6) - INTERVAL 1 SECOND;
    ELSE
      UPDATE b_gen SET cur = (cur + 1) % 3 WHERE one = 1;
      SELECT (cur + 1) % 3 INTO old FROM b_gen WHERE one = 1;
      SELECT COUNT(*) INTO n FROM (SELECT 1 FROM b_ready WHERE gen = old LIMIT 1) x;
      IF n = 0 THEN
        SET @truncate = CONCAT('ALTER TABLE b_ready TRUNCATE PARTITION p', old);
        PREPARE s FROM @truncate;
        EXECUTE s;
        DEALLOCATE PREPARE s;
      END IF;
      DELETE FROM b_jobs WHERE state = 'completed' AND finished_at < NOW(6) - INTERVAL 1 SECOND;
    END IF;
    INSERT INTO sizes SELECT layout, NOW(6),
      (SELECT SUM(data_length + index_length) FROM information_schema.tables
        WHERE table_schema = DATABASE() AND table_name IN ('a_jobs', 'b_ready')),
      (SELECT SUM(data_length + index_length) FROM information_schema.tables
        WHERE table_schema = DATABASE() AND table_name = 'b_jobs'),
      (SELECT count FROM information_schema.innodb_metrics WHERE name = 'trx_rseg_history_len');
    DO SLEEP(1);
  END WHILE;
END //
DELIMITER ;

//! MariaDB rotates (with a nonzero interval) only while InnoDB's purge lags: a truncate fails
//! older REPEATABLE READ transactions that then change a waiting job (1412), so it is worth
//! that only while delete-marked entries pile up.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::jobs;
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, count};

fn history(conn: &mut AnyConnection) -> i64 {
    count(
        conn,
        "SELECT CAST(VARIABLE_VALUE AS SIGNED) AS n FROM information_schema.GLOBAL_STATUS \
         WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'",
    )
}

fn generation(conn: &mut AnyConnection) -> i64 {
    count(conn, "SELECT generation AS n FROM tenure_ready_ring")
}

/// On the private server (whose other tests run one at a time, in this one's group, so its
/// history list is this test's own): once purge has caught up, a due rotation with a
/// nonzero interval does nothing; with a read view held open and 6,000 transactions' undo
/// behind it, the same call rotates. (Reading the list by a column MariaDB does not have
/// once made every call rotate.)
#[test]
fn mysql_rotations_wait_while_purge_keeps_up() {
    let db = TestDb::restartable(Backend::Mysql);
    let mut conn = db.connect();
    // Due at every call: the last rotation is always more than a microsecond old.
    let interval = Duration::from_micros(1);
    let give_up = Instant::now() + Duration::from_secs(60);
    while history(&mut conn) > 100 {
        assert!(
            Instant::now() < give_up,
            "purge did not catch up on a quiet server in 60 s: history list {}",
            history(&mut conn)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = generation(&mut conn);
    for call in 0..3 {
        let rotated = jobs::rotate_ready(&mut conn, interval).unwrap();
        let length = history(&mut conn);
        assert!(
            rotated.is_none() || length > 5_000,
            "call {call}: rotated ({rotated:?}) while purge keeps up (history list {length})"
        );
    }
    assert_eq!(
        generation(&mut conn),
        before,
        "no rotation while purge keeps up"
    );

    let mut holder = db.connect();
    holder
        .batch_execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        .unwrap();
    // 6,000 committed transactions, each leaving undo the held read view keeps from purge.
    conn.batch_execute(
        "CREATE TABLE churn (id INT PRIMARY KEY, v INT); INSERT INTO churn VALUES (1, 0)",
    )
    .unwrap();
    conn.batch_execute(
        "BEGIN NOT ATOMIC DECLARE i INT DEFAULT 0; \
         WHILE i < 6000 DO UPDATE churn SET v = v + 1 WHERE id = 1; SET i = i + 1; END WHILE; \
         END",
    )
    .unwrap();
    let length = history(&mut conn);
    assert!(
        length > 5_000,
        "history list {length} behind a held read view"
    );
    let rotated = jobs::rotate_ready(&mut conn, interval).unwrap();
    assert!(
        rotated.is_some(),
        "no rotation while purge lags (history list {length}): {rotated:?}"
    );
    assert_eq!(generation(&mut conn), before + 1);
    holder.batch_execute("ROLLBACK").unwrap();
}

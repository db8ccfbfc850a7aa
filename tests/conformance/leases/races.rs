//! The race the reference report describes: contenders taking one name at the same instant,
//! over an absent, an expired and a released row, have one winner each round (and the naive
//! read-then-update, the negative control, lets several win).

use std::sync::{Arc, Barrier};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::lease::{self, Lease};
use tenure::{AnyConnection, Backend, TenureConnection};

use super::{LONG, raw_lease};
use crate::common::{TestDb, conformance, contest, now_sql, placeholders, race};

conformance!(
    race_over_an_absent_row_has_one_winner,
    race_over_an_expired_row_has_one_winner,
    race_over_a_released_row_has_one_winner,
    naive_read_then_update_lets_several_win,
);

const CONTENDERS: usize = 16;
const ROUNDS: usize = 200;

/// Makes a lease expired by the database's clock without waiting: expiry = acquisition.
fn expire(conn: &mut AnyConnection, name: &str) {
    let sql = format!(
        "UPDATE tenure_leases SET expires_at = acquired_at, reusable_at = acquired_at WHERE name = {}",
        placeholders(conn.backend(), 1)
    );
    let changed = diesel::sql_query(sql)
        .bind::<Text, _>(name)
        .execute(conn)
        .unwrap();
    assert_eq!(changed, 1);
}

#[derive(Clone, Copy, Debug)]
enum Start {
    Absent,
    Expired,
    Released,
}

/// 16 threads on their own connections try to take one name at the same instant, 200 rounds:
/// exactly one winner and no error in every round, and fences strictly increase.
fn race_to_take(backend: Backend, start: Start) {
    let db = TestDb::migrated(backend);
    let mut main = db.connect();
    let name_of = move |round: usize| match start {
        Start::Absent => format!("absent-{round}"),
        _ => "contended".to_string(),
    };
    if !matches!(start, Start::Absent) {
        let mut first = lease::try_take(&mut main, "contended", LONG, "setup")
            .unwrap()
            .unwrap();
        match start {
            Start::Expired => expire(&mut main, "contended"),
            _ => assert!(first.release(&mut main).unwrap()),
        }
    }
    let mut last_fence = match start {
        Start::Absent => 0,
        _ => 1,
    };
    let (mut winners, mut errors) = (0, 0);
    contest(
        &db,
        CONTENDERS,
        ROUNDS,
        move |round, i, conn| lease::try_take(conn, &name_of(round), LONG, &format!("thread {i}")),
        |round, outcomes| {
            let mut won: Vec<Lease> = Vec::new();
            for outcome in outcomes {
                match outcome {
                    Ok(Some(lease)) => won.push(lease),
                    Ok(None) => {}
                    Err(e) => {
                        errors += 1;
                        panic!("round {round}: a contender got an error: {e:?}");
                    }
                }
            }
            assert_eq!(won.len(), 1, "round {round}: {} winners", won.len());
            winners += 1;
            let mut lease = won.pop().unwrap();
            match start {
                Start::Absent => assert_eq!(lease.fence(), 1),
                _ => {
                    assert!(lease.fence() > last_fence, "round {round}: fence went back");
                    last_fence = lease.fence();
                }
            }
            let stored = raw_lease(&mut main, lease.name());
            assert_eq!(stored.token, Some(lease.token()));
            assert_eq!(stored.fence, lease.fence());
            match start {
                Start::Expired => expire(&mut main, lease.name()),
                Start::Released => assert!(lease.release(&mut main).unwrap()),
                Start::Absent => {}
            }
        },
    );
    println!(
        "{backend} take race over {start:?} row: {ROUNDS} rounds x {CONTENDERS} contenders, \
         {winners} rounds with exactly one winner, {errors} errors, last fence {last_fence}"
    );
}

fn race_over_an_absent_row_has_one_winner(backend: Backend) {
    race_to_take(backend, Start::Absent);
}

fn race_over_an_expired_row_has_one_winner(backend: Backend) {
    race_to_take(backend, Start::Expired);
}

fn race_over_a_released_row_has_one_winner(backend: Backend) {
    race_to_take(backend, Start::Released);
}

/// The pattern of the reference report: read the row without a lock, and if it is expired,
/// UPDATE it without re-checking expiry. A barrier between the read and the update makes
/// every contender read before any writes. This shows the race test above can see the bug.
fn naive_take(conn: &mut AnyConnection, name: &str, i: usize, barrier: &Barrier) -> bool {
    let backend = conn.backend();
    let free = format!(
        "SELECT COUNT(*) AS n FROM tenure_leases WHERE name = {} AND (token IS NULL OR expires_at <= {})",
        placeholders(backend, 1),
        now_sql(backend)
    );
    let grab = match backend {
        Backend::Postgres => {
            "UPDATE tenure_leases SET holder = $1, fence = fence + 1 WHERE name = $2"
        }
        _ => "UPDATE tenure_leases SET holder = ?, fence = fence + 1 WHERE name = ?",
    };
    let attempt = |c: &mut AnyConnection| -> QueryResult<bool> {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let is_free = diesel::sql_query(&free)
            .bind::<Text, _>(name)
            .get_result::<N>(c)?
            .n
            == 1;
        barrier.wait();
        if !is_free {
            return Ok(false);
        }
        let changed = diesel::sql_query(grab)
            .bind::<Text, _>(format!("naive {i}"))
            .bind::<Text, _>(name)
            .execute(c)?;
        Ok(changed == 1)
    };
    match backend {
        // As in the report: one READ COMMITTED (PostgreSQL) or default (MySQL) transaction.
        Backend::Postgres | Backend::Mysql => conn.transaction(attempt),
        // SQLite serializes transactions that write; in autocommit the read and the write
        // are separate, as the pattern has them.
        Backend::Sqlite => attempt(conn),
    }
    .expect("naive take")
}

fn naive_read_then_update_lets_several_win(backend: Backend) {
    const NAIVE_ROUNDS: usize = 20;
    const NAIVE_CONTENDERS: usize = 8;
    let db = TestDb::migrated(backend);
    let mut main = db.connect();
    lease::try_take(&mut main, "naive", LONG, "setup")
        .unwrap()
        .unwrap();
    let mut total = 0;
    for round in 0..NAIVE_ROUNDS {
        expire(&mut main, "naive");
        let barrier = Arc::new(Barrier::new(NAIVE_CONTENDERS));
        let winners = race(&db, NAIVE_CONTENDERS, move |i, conn| {
            naive_take(conn, "naive", i, &barrier)
        })
        .into_iter()
        .filter(|won| *won)
        .count();
        assert!(
            winners >= 2,
            "round {round}: the naive pattern had {winners} winner(s)"
        );
        total += winners;
    }
    println!(
        "{backend} naive negative control: {NAIVE_ROUNDS} rounds x {NAIVE_CONTENDERS} contenders, \
         {total} winners in all (every round had 2 or more)"
    );
}

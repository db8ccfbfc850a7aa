//! Bulk enqueue of plain jobs (`enqueue_many` without keys or dependencies): every field
//! kept, ids in the batch's order, the due times on the database's clock, limits recorded,
//! all or nothing. On PostgreSQL a batch this long goes by COPY, elsewhere by multi-row
//! INSERTs: one behaviour.

use std::time::Duration;

use chrono::{SubsecRound, TimeDelta, Utc};
use dibs::Backend;
use dibs::jobs::{self, JobState, NewJob};

use crate::support::{TestDb, conformance, count, now_sql};

conformance!(
    a_long_plain_batch_keeps_every_field_in_order,
    a_long_batch_in_a_rolled_back_transaction_leaves_nothing,
);

/// Longer than the shortest batch that PostgreSQL copies.
const N: usize = 300;

fn a_long_plain_batch_keeps_every_field_in_order(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let at = (Utc::now() + TimeDelta::days(3)).trunc_subsecs(3);
    let queue = |i: usize| ["a", "b", "c"][i % 3];
    let kind = |i: usize| format!("kind{}", i % 5);
    let payload = |i: usize| -> Vec<u8> { (0..(i % 40)).map(|b| (b * 7 + i) as u8).collect() };
    let batch: Vec<NewJob> = (0..N)
        .map(|i| {
            let job = NewJob::new(queue(i), kind(i), payload(i))
                .priority(i as i32 % 7 - 3)
                .max_attempts(1 + (i as u32 % 9));
            match i % 4 {
                0 => job.delay(Duration::from_secs(3600)),
                1 => job.at(at),
                2 => job.limit("lk", 3),
                _ => job,
            }
        })
        .collect();
    let before = db_now(&mut conn);
    let enqueued = jobs::enqueue_many(&mut conn, &batch).unwrap();
    let after = db_now(&mut conn);
    assert_eq!(enqueued.len(), N);
    assert!(
        enqueued.windows(2).all(|w| w[0].id < w[1].id),
        "ids ascend in the batch's order"
    );
    for (i, e) in enqueued.iter().enumerate() {
        assert!(!e.existing && !e.updated);
        let got = jobs::get(&mut conn, e.id).unwrap().expect("the job");
        assert_eq!(got.queue, queue(i), "job {i}");
        assert_eq!(got.kind, kind(i), "job {i}");
        assert_eq!(got.payload, payload(i), "job {i}");
        assert_eq!(got.priority, i as i32 % 7 - 3, "job {i}");
        assert_eq!(got.max_attempts, 1 + (i as u32 % 9), "job {i}");
        assert_eq!((got.state, got.attempt), (JobState::Waiting, 0), "job {i}");
        // Created on the database's clock, within the call.
        assert!(
            got.created_at >= before - TimeDelta::milliseconds(1) && got.created_at <= after,
            "job {i} created at {} outside [{before}, {after}]",
            got.created_at
        );
        let due = match i % 4 {
            0 => got.created_at + TimeDelta::hours(1),
            1 => at,
            _ => got.created_at,
        };
        assert!(
            (got.due_at - due).abs() <= TimeDelta::milliseconds(2),
            "job {i} due {} expected {due}",
            got.due_at
        );
        let limits = jobs::limits_of(&mut conn, e.id).unwrap();
        assert_eq!(limits.len(), usize::from(i % 4 == 2), "job {i}'s limits");
    }
    // The limit holds back its jobs as ever: claim all, at most 3 of key lk run.
    let claimed = jobs::claim(&mut conn, "c", 500, Duration::from_secs(60)).unwrap();
    let limited = claimed
        .iter()
        .filter(|j| enqueued.iter().position(|e| e.id == j.id).unwrap() % 4 == 2)
        .count();
    assert!(limited <= 3, "{limited} jobs of a limit of 3 claimed");
}

fn a_long_batch_in_a_rolled_back_transaction_leaves_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..N)
        .map(|i| NewJob::new("q", "k", vec![i as u8]).limit("lk", 2))
        .collect();
    let rolled_back: Result<(), dibs::Error> = dibs::transaction(&mut conn, |conn| {
        jobs::enqueue_many(conn, &batch)?;
        Err(diesel::result::Error::RollbackTransaction.into())
    });
    assert!(rolled_back.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM dibs_jobs"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM dibs_job_limits"),
        0
    );
    // And the ids it took are not given to anyone twice afterwards.
    let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids.len(), N);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM dibs_jobs"),
        N as i64
    );
}

fn db_now(conn: &mut dibs::AnyConnection) -> chrono::DateTime<Utc> {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Now {
        #[diesel(sql_type = dibs::sql_types::Instant)]
        now: chrono::DateTime<Utc>,
    }
    let sql = format!(
        "SELECT {} AS now",
        now_sql(dibs::DibsConnection::backend(conn))
    );
    crate::support::concrete!(conn, c => diesel::sql_query(&sql).get_result::<Now>(c))
        .unwrap()
        .now
}

/// dibs_jobs turns over every row: PostgreSQL vacuums it after a fixed number of dead row
/// versions, not after a fifth of the table (the default), which on a small busy table
/// means many times its live rows.
#[cfg(feature = "postgres")]
#[test]
fn postgres_vacuums_dibs_jobs_by_dead_versions_not_by_share() {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Options {
        #[diesel(sql_type = diesel::sql_types::Text)]
        options: String,
    }
    let db = TestDb::migrated(Backend::Postgres);
    let mut conn = db.connect();
    let got = diesel::sql_query(
        "SELECT array_to_string(reloptions, ',') AS options FROM pg_class \
         WHERE relname = 'dibs_jobs' AND relnamespace = current_schema()::regnamespace",
    )
    .get_result::<Options>(&mut conn)
    .unwrap()
    .options;
    for option in [
        "autovacuum_vacuum_scale_factor=0",
        "autovacuum_vacuum_threshold=5000",
    ] {
        assert!(got.split(',').any(|o| o == option), "{option} not in {got}");
    }
}

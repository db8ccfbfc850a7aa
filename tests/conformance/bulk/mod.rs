//! Bulk enqueue of plain jobs (`enqueue_many` without keys or dependencies): every field
//! kept, ids in the batch's order, the due times on the database's clock, limits recorded,
//! all or nothing. On PostgreSQL a batch this long goes by COPY, elsewhere by multi-row
//! INSERTs: one behaviour.

#[cfg(feature = "postgres")]
mod copy;
mod edges;
mod server_settings;

use std::time::Duration;

use chrono::{SubsecRound, TimeDelta, Utc};
use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob, OnDuplicate};

use crate::common::{TestDb, conformance, count, now_sql, race};

conformance!(
    a_long_plain_batch_keeps_every_field_in_order,
    a_long_batch_in_a_rolled_back_transaction_leaves_nothing,
    a_keyed_batch_enqueued_twice_makes_each_job_once,
    keyed_batches_racing_make_one_job_a_key,
    long_bulks_of_many_chunks_keep_every_job_in_its_place,
    a_bulks_names_payloads_and_instants_come_back_exactly,
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
    let rolled_back: Result<(), tenure::Error> = tenure::transaction(&mut conn, |conn| {
        jobs::enqueue_many(conn, &batch)?;
        Err(diesel::result::Error::RollbackTransaction.into())
    });
    assert!(rolled_back.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_limits"),
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
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        N as i64
    );
}

fn db_now(conn: &mut tenure::AnyConnection) -> chrono::DateTime<Utc> {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Now {
        #[diesel(sql_type = tenure::sql_types::Instant)]
        now: chrono::DateTime<Utc>,
    }
    let sql = format!(
        "SELECT {} AS now",
        now_sql(tenure::TenureConnection::backend(conn))
    );
    crate::common::concrete!(conn, c => diesel::sql_query(&sql).get_result::<Now>(c))
        .unwrap()
        .now
}

/// tenure_jobs turns over every row: PostgreSQL vacuums it after a fixed number of dead row
/// versions, not after a fifth of the table (the default), which on a small busy table
/// means many times its live rows.
#[cfg(feature = "postgres")]
#[test]
fn postgres_vacuums_tenure_jobs_by_dead_versions_not_by_share() {
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
         WHERE relname = 'tenure_jobs_kept' AND relnamespace = current_schema()::regnamespace",
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

/// A bulk enqueue whose outcome was unknown (a dropped connection at commit) is retried with
/// the same batch: keyed jobs make it idempotent, at bulk speed (multi-row upserts where
/// the backend returns rows). Keys already live fold, a key twice in the batch folds into
/// its first, modes apply, limits are recorded for new jobs only.
fn a_keyed_batch_enqueued_twice_makes_each_job_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let live = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "k", b"old".to_vec()).dedup_key("key7"),
    )
    .unwrap();
    let batch: Vec<NewJob> = (0..N)
        .map(|i| {
            // Every 50th job repeats the key of the one before it.
            let key = if i % 50 == 49 { i - 1 } else { i };
            let job = NewJob::new("q", "k", format!("p{i}").into_bytes())
                .dedup_key(format!("key{key}"))
                .limit("lk", 5);
            if i >= 200 {
                job.on_duplicate(OnDuplicate::Replace)
            } else {
                job
            }
        })
        .collect();
    let first = jobs::enqueue_many(&mut conn, &batch).unwrap();
    assert_eq!(first.len(), N);
    for (i, e) in first.iter().enumerate() {
        let twin = i % 50 == 49;
        assert_eq!(e.existing, i == 7 || twin, "job {i}: {e:?}");
        if i == 7 {
            assert_eq!(e.id, live.id);
        }
        if twin {
            assert_eq!(e.id, first[i - 1].id, "job {i} folds into its twin");
        }
    }
    let distinct = N - N / 50;
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        distinct as i64
    );
    // Limits for the jobs made (not the live one folded into).
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_limits"),
        distinct as i64 - 1
    );
    let new_ids: Vec<i64> = first.iter().filter(|e| !e.existing).map(|e| e.id).collect();
    assert!(
        new_ids.windows(2).all(|w| w[0] < w[1]),
        "new jobs' ids ascend in order"
    );
    // The retry: nothing new, every id the same.
    let again = jobs::enqueue_many(&mut conn, &batch).unwrap();
    for (i, (a, b)) in first.iter().zip(&again).enumerate() {
        assert!(b.existing, "job {i} made twice");
        assert_eq!(a.id, b.id, "job {i}");
        // Replace applied to the waiting jobs of the same kind.
        assert_eq!(b.updated, i >= 200, "job {i}: {b:?}");
    }
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        distinct as i64
    );
    let replaced = jobs::get(&mut conn, again[250].id).unwrap().unwrap();
    assert_eq!(replaced.payload, b"p250");
}

/// Four connections enqueue overlapping keyed batches at once, many rounds: one job a key,
/// and every caller is given that job's id.
fn keyed_batches_racing_make_one_job_a_key(backend: Backend) {
    const ROUNDS: usize = 8;
    const KEYS: usize = 120;
    let db = TestDb::migrated(backend);
    let results = race(&db, 4, |t, conn| {
        let mut seen = Vec::new();
        for round in 0..ROUNDS {
            // Each thread its own order of the same keys.
            let mut keys: Vec<usize> = (0..KEYS).collect();
            keys.rotate_left(t * 30);
            let batch: Vec<NewJob> = keys
                .iter()
                .map(|k| NewJob::new("q", "k", vec![]).dedup_key(format!("r{round}k{k}")))
                .collect();
            let enqueued = jobs::enqueue_many(conn, &batch).expect("enqueue_many");
            seen.extend(keys.iter().zip(enqueued).map(|(k, e)| ((round, *k), e.id)));
        }
        seen
    });
    let mut ids = std::collections::HashMap::new();
    for (key, id) in results.into_iter().flatten() {
        let first = *ids.entry(key).or_insert(id);
        assert_eq!(first, id, "key {key:?} got two jobs");
    }
    let mut conn = db.connect();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        (ROUNDS * KEYS) as i64
    );
}

/// A bulk of many chunks (statements of `INSERT_CHUNK_ROWS` rows), plain and keyed, twice on
/// one connection: 2,345 jobs a call (full chunks and a short one), every job in its place,
/// ids in the batch's order, the keyed batch's second call folding each job into its first.
fn long_bulks_of_many_chunks_keep_every_job_in_its_place(backend: Backend) {
    const LONG: usize = 2_345;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let payload = |call: usize, i: usize| format!("{call}:{i}").into_bytes();
    // Jobs read back: every 97th, and each side of a chunk's edge at 100 and 1,000 rows.
    let spots = || {
        (0..LONG)
            .step_by(97)
            .chain([99, 100, 999, 1000, 2299, 2300, LONG - 1])
    };
    for call in 0..2 {
        let plain: Vec<NewJob> = (0..LONG)
            .map(|i| NewJob::new("plain", "k", payload(call, i)).priority((i % 5) as i32))
            .collect();
        let enqueued = jobs::enqueue_many(&mut conn, &plain).unwrap();
        assert_eq!(enqueued.len(), LONG);
        assert!(
            enqueued.windows(2).all(|w| w[0].id < w[1].id),
            "call {call}"
        );
        for i in spots() {
            let got = jobs::get(&mut conn, enqueued[i].id)
                .unwrap()
                .expect("the job");
            assert_eq!(got.payload, payload(call, i), "call {call}, job {i}");
            assert_eq!(got.priority, (i % 5) as i32, "call {call}, job {i}");
        }
    }
    let keyed = |call: usize| -> Vec<NewJob> {
        (0..LONG)
            .map(|i| {
                NewJob::new("keyed", "k", payload(call, i))
                    .dedup_key(format!("key{i}"))
                    .on_duplicate(OnDuplicate::Replace)
            })
            .collect()
    };
    let first = jobs::enqueue_many(&mut conn, &keyed(0)).unwrap();
    let second = jobs::enqueue_many(&mut conn, &keyed(1)).unwrap();
    for (i, (a, b)) in first.iter().zip(&second).enumerate() {
        assert!(!a.existing, "job {i}: {a:?}");
        assert!(
            b.existing && b.updated && b.id == a.id,
            "job {i}: {a:?} then {b:?}"
        );
    }
    for i in spots() {
        let got = jobs::get(&mut conn, second[i].id)
            .unwrap()
            .expect("the job");
        assert_eq!(got.payload, payload(1, i), "keyed job {i}");
    }
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        3 * LONG as i64
    );
}

/// Every text a name may hold (quotes, backslashes, control characters, trailing spaces,
/// four-byte characters, the longest length), every byte value, the largest payloads beside
/// empty ones and instants to the backend's precision come back exactly from a bulk's plain
/// and keyed runs (MariaDB sends them as JSON text, PostgreSQL copies long runs).
fn a_bulks_names_payloads_and_instants_come_back_exactly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let longest = format!("{}abc", "\u{1F600}".repeat(63));
    assert_eq!(longest.len(), tenure::MAX_NAME_BYTES);
    let names = [
        "q \"'\\\n\t\r\u{7}",
        "\u{e9}\u{1F600} ",
        "null",
        "[1, 2]",
        longest.as_str(),
        " ",
    ];
    let digits = if backend == Backend::Sqlite { 3 } else { 6 };
    let at =
        (Utc::now() + TimeDelta::days(2) + TimeDelta::microseconds(123_457)).trunc_subsecs(digits);
    let payload = |i: usize| -> Vec<u8> {
        match i % 7 {
            3 => vec![(i as u8).wrapping_mul(31); jobs::MAX_PAYLOAD_BYTES],
            5 => vec![],
            _ => (0..=255u8).cycle().skip(i).take(300).collect(),
        }
    };
    let job = |i: usize| {
        let name = names[i % names.len()];
        NewJob::new(name, name, payload(i))
            .at(at)
            .limit(name, 2)
            .fair_key(name)
    };
    let check = |conn: &mut tenure::AnyConnection, id: i64, i: usize, what: &str| {
        let name = names[i % names.len()];
        let got = jobs::get(conn, id).unwrap().expect("the job");
        assert_eq!(
            (got.queue.as_str(), got.kind.as_str()),
            (name, name),
            "{what} job {i}"
        );
        assert!(got.payload == payload(i), "{what} job {i}'s payload");
        assert_eq!(got.due_at, at, "{what} job {i}");
        let limits = jobs::limits_of(conn, id).unwrap();
        assert_eq!(limits.len(), 1, "{what} job {i}");
        assert_eq!(limits[0].key(), name, "{what} job {i}");
    };
    let plain: Vec<NewJob> = (0..40).map(job).collect();
    let enqueued = jobs::enqueue_many(&mut conn, &plain).unwrap();
    for (i, e) in enqueued.iter().enumerate() {
        check(&mut conn, e.id, i, "plain");
    }
    let keyed = |round: usize| -> Vec<NewJob> {
        (0..12)
            .map(|i| {
                let name: String = names[i % names.len()].chars().take(50).collect();
                job(i).dedup_key(format!("{i:02}{round}{name}"))
            })
            .collect()
    };
    let first = jobs::enqueue_many(&mut conn, &keyed(0)).unwrap();
    let again = jobs::enqueue_many(&mut conn, &keyed(0)).unwrap();
    for (i, (a, b)) in first.iter().zip(&again).enumerate() {
        assert!(
            !a.existing && b.existing && a.id == b.id,
            "keyed job {i}: {a:?} {b:?}"
        );
        check(&mut conn, a.id, i, "keyed");
    }
}

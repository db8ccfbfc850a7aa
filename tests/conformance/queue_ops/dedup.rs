//! Deduplication by key under concurrent enqueues, and what a bulk enqueue reports for each
//! item (its duplicates, and each job's own id while other connections insert too).

use std::collections::HashMap;

use diesel::prelude::*;
use tenure::Backend;
use tenure::jobs::{self, NewJob};
use tenure::schema::tenure_jobs;

use super::TTL;
use crate::common::{TestDb, conformance, count, race};

conformance!(
    eight_enqueues_with_one_key_make_one_job,
    enqueue_many_reports_each_item,
    concurrent_bulk_enqueues_return_each_job_its_own_id,
);

fn eight_enqueues_with_one_key_make_one_job(backend: Backend) {
    let db = TestDb::migrated(backend);
    for round in 0..10 {
        let key = format!("report-{round}");
        let results = race(&db, 8, move |i, conn| {
            jobs::enqueue(
                conn,
                &NewJob::new("dedup", "k", vec![i as u8]).dedup_key(key.as_str()),
            )
        });
        let got: Vec<jobs::Enqueued> = results
            .into_iter()
            .map(|r| r.expect("no enqueue fails"))
            .collect();
        let id = got[0].id;
        assert!(got.iter().all(|e| e.id == id), "round {round}: {got:?}");
        assert_eq!(
            got.iter().filter(|e| !e.existing).count(),
            1,
            "round {round}: {got:?}"
        );
    }
    let mut conn = db.connect();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        10
    );
    // While it runs the key is taken; once it completes, the key is free again.
    let first = jobs::enqueue(
        &mut conn,
        &NewJob::new("dedup", "k", vec![]).dedup_key("again"),
    )
    .unwrap();
    let job = jobs::claim(&mut conn, "dedup", 100, TTL)
        .unwrap()
        .into_iter()
        .find(|j| j.id == first.id)
        .unwrap();
    let running = jobs::enqueue(
        &mut conn,
        &NewJob::new("dedup", "k", vec![]).dedup_key("again"),
    )
    .unwrap();
    assert_eq!((running.id, running.existing), (first.id, true));
    // Same key, other queue: independent. Keys are byte-exact.
    assert!(
        !jobs::enqueue(
            &mut conn,
            &NewJob::new("other", "k", vec![]).dedup_key("again")
        )
        .unwrap()
        .existing
    );
    assert!(
        !jobs::enqueue(
            &mut conn,
            &NewJob::new("dedup", "k", vec![]).dedup_key("Again")
        )
        .unwrap()
        .existing
    );
    jobs::complete(&mut conn, &[job.claim()]).unwrap();
    let after = jobs::enqueue(
        &mut conn,
        &NewJob::new("dedup", "k", vec![]).dedup_key("again"),
    )
    .unwrap();
    assert!(!after.existing && after.id != first.id);
    println!(
        "{backend} dedup: 10 rounds x 8 concurrent enqueues of one key: one job each, all 8 got its id"
    );
}

/// Multi-row inserts from several connections at once: every id returned is the row of the
/// job given at that position (on MySQL the ids are computed from `LAST_INSERT_ID()`, which
/// holds only if no other statement's rows interleave).
fn concurrent_bulk_enqueues_return_each_job_its_own_id(backend: Backend) {
    const THREADS: usize = 4;
    const ROUNDS: usize = 5;
    const BATCH: usize = 700;
    let db = TestDb::migrated(backend);
    let results = race(&db, THREADS, |t, conn| {
        let mut mine = Vec::new();
        for round in 0..ROUNDS {
            let payloads: Vec<Vec<u8>> = (0..BATCH)
                .map(|i| format!("{t}/{round}/{i}").into_bytes())
                .collect();
            let batch: Vec<NewJob> = payloads
                .iter()
                .map(|p| NewJob::new("bulk", "k", p.clone()))
                .collect();
            let enqueued = jobs::enqueue_many(conn, &batch).expect("enqueue_many");
            mine.extend(enqueued.into_iter().map(|e| e.id).zip(payloads));
        }
        mine
    });
    // Every job's payload in one read (14,000 single reads took most of a minute on MariaDB
    // under load: nextest's limit).
    let mut conn = db.connect();
    let stored: HashMap<i64, Vec<u8>> = tenure_jobs::table
        .filter(tenure_jobs::queue.eq("bulk"))
        .select((tenure_jobs::id, tenure_jobs::payload))
        .load::<(i64, Vec<u8>)>(&mut conn)
        .unwrap()
        .into_iter()
        .collect();
    let mut seen = std::collections::HashSet::new();
    for (id, payload) in results.into_iter().flatten() {
        assert!(seen.insert(id), "id {id} returned twice");
        let stored = stored.get(&id).expect("the job exists");
        assert_eq!(*stored, payload, "id {id} is another job's");
    }
    assert_eq!(seen.len(), THREADS * ROUNDS * BATCH);
    assert_eq!(stored.len(), seen.len(), "jobs no enqueue returned");
}

fn enqueue_many_reports_each_item(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let live = jobs::enqueue(&mut conn, &NewJob::new("m", "k", vec![]).dedup_key("a")).unwrap();
    let batch = vec![
        NewJob::new("m", "k", b"1".to_vec()),
        NewJob::new("m", "k", b"2".to_vec()).dedup_key("a"),
        NewJob::new("m", "k", b"3".to_vec()).dedup_key("b"),
        NewJob::new("m", "k", b"4".to_vec()),
        NewJob::new("m", "k", b"5".to_vec()).dedup_key("b"),
        NewJob::new("m", "k", b"6".to_vec()),
    ];
    let got = jobs::enqueue_many(&mut conn, &batch).unwrap();
    let existing: Vec<bool> = got.iter().map(|e| e.existing).collect();
    assert_eq!(existing, vec![false, true, false, false, true, false]);
    assert_eq!(got[1].id, live.id);
    assert_eq!(
        got[4].id, got[2].id,
        "a duplicate inside the batch gets the first one's id"
    );
    for (i, e) in got.iter().enumerate() {
        if !e.existing {
            assert_eq!(
                jobs::get(&mut conn, e.id).unwrap().unwrap().payload,
                vec![b"123456"[i]]
            );
        }
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 5);
}

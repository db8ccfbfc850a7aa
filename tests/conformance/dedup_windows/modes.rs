//! The modes for a live duplicate: Replace (a debounce race leaves one job with the last
//! payload; a running job is never changed) and KeepEarlierDue (the earlier due time wins,
//! whichever comes first).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tenure::Backend;
use tenure::jobs::{self, OnDuplicate};

use super::{TTL, folded, keyed};
use crate::common::{TestDb, conformance, contest, count};

conformance!(
    debounce_leaves_one_job_with_the_last_payload,
    replace_never_changes_a_running_job,
    keep_earlier_due_takes_the_earlier_whichever_comes_first,
);

/// 8 threads on their own connections enqueue one key at once with Replace, 100 rounds: one
/// job per round, which holds the payload and due time of the enqueue that updated it last
/// (the one whose transaction saw 7 hits on it: they update one after the other under the
/// row's lock), and every other enqueue was folded into it and applied.
fn debounce_leaves_one_job_with_the_last_payload(backend: Backend) {
    const THREADS: usize = 8;
    const ROUNDS: usize = 100;
    let db = TestDb::migrated(backend);
    let base = DateTime::<Utc>::from_timestamp(2_000_000_000, 0).unwrap();
    let due = move |thread: usize| base + chrono::Duration::seconds(thread as i64);
    let mut check = db.connect();
    contest(
        &db,
        THREADS,
        ROUNDS,
        move |round, thread, conn| {
            let job = keyed("d", &format!("r{round}"), &format!("{round}/{thread}"))
                .at(due(thread))
                .on_duplicate(OnDuplicate::Replace);
            tenure::transaction(conn, |c| {
                let enqueued = jobs::enqueue(c, &job)?;
                // This enqueue's place in the order: the hits its own update left.
                let hits = jobs::get(c, enqueued.id)?.expect("the job").dedup_hits;
                Ok::<_, tenure::Error>((enqueued, hits))
            })
            .expect("enqueue")
        },
        |round, outcomes| {
            let id = outcomes[0].0.id;
            assert!(
                outcomes.iter().all(|(e, _)| e.id == id),
                "round {round}: {outcomes:?}"
            );
            let new: Vec<_> = outcomes.iter().filter(|(e, _)| !e.existing).collect();
            assert_eq!(new.len(), 1, "round {round}: {outcomes:?}");
            assert_eq!(new[0].1, 0, "the inserter came first");
            assert!(
                outcomes.iter().all(|(e, _)| e.existing == e.updated),
                "round {round}: every duplicate applied to the waiting job: {outcomes:?}"
            );
            let mut order: Vec<i64> = outcomes.iter().map(|(_, hits)| *hits).collect();
            order.sort_unstable();
            assert_eq!(
                order,
                (0..THREADS as i64).collect::<Vec<_>>(),
                "round {round}"
            );
            let last = outcomes
                .iter()
                .position(|(_, hits)| *hits == THREADS as i64 - 1)
                .expect("a last one");
            let job = jobs::get(&mut check, id).unwrap().unwrap();
            assert_eq!(job.dedup_hits, THREADS as i64 - 1);
            assert_eq!(
                job.payload,
                format!("{round}/{last}").into_bytes(),
                "round {round}"
            );
            assert_eq!(job.due_at, due(last), "round {round}");
            assert_eq!(
                count(
                    &mut check,
                    &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE dedup_key = 'r{round}'")
                ),
                1
            );
        },
    );
    println!(
        "{backend} debounce: {ROUNDS} rounds x {THREADS} enqueues: one job each, the last payload"
    );
}

fn replace_never_changes_a_running_job(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &keyed("r", "k", "first"))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "r", 1, TTL).unwrap().remove(0);
    for mode in [
        OnDuplicate::Replace,
        OnDuplicate::KeepEarlierDue,
        OnDuplicate::Keep,
    ] {
        let dup = keyed("r", "k", "second")
            .at(DateTime::<Utc>::from_timestamp(0, 0).unwrap())
            .on_duplicate(mode);
        assert_eq!(
            jobs::enqueue(&mut conn, &dup).unwrap(),
            folded(id),
            "{mode:?}"
        );
    }
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(
        (job.payload.as_slice(), job.due_at),
        (&b"first"[..], claimed.due_at)
    );
    assert_eq!(job.dedup_hits, 3);
}

fn keep_earlier_due_takes_the_earlier_whichever_comes_first(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let at = |secs: i64| DateTime::<Utc>::from_timestamp(2_000_000_000 + secs, 0).unwrap();
    let earlier = |key: &str, payload: &str, secs: i64| {
        keyed("e", key, payload)
            .at(at(secs))
            .on_duplicate(OnDuplicate::KeepEarlierDue)
    };
    // The later one first, then the earlier: moved.
    let a = jobs::enqueue(&mut conn, &earlier("a", "first", 60))
        .unwrap()
        .id;
    let dup = jobs::enqueue(&mut conn, &earlier("a", "second", 30)).unwrap();
    assert_eq!((dup.id, dup.existing, dup.updated), (a, true, true));
    let job = jobs::get(&mut conn, a).unwrap().unwrap();
    assert_eq!(
        (job.due_at, job.payload.as_slice()),
        (at(30), &b"first"[..])
    );
    // The earlier one first, then the later: stays.
    let b = jobs::enqueue(&mut conn, &earlier("b", "first", 30))
        .unwrap()
        .id;
    assert!(
        jobs::enqueue(&mut conn, &earlier("b", "second", 60))
            .unwrap()
            .existing
    );
    let job = jobs::get(&mut conn, b).unwrap().unwrap();
    assert_eq!(
        (job.due_at, job.payload.as_slice()),
        (at(30), &b"first"[..])
    );
    // With delays (database clock): an hour, then now.
    let c = jobs::enqueue(
        &mut conn,
        &keyed("e", "c", "x")
            .delay(Duration::from_secs(3600))
            .on_duplicate(OnDuplicate::KeepEarlierDue),
    )
    .unwrap()
    .id;
    let now = keyed("e", "c", "y").on_duplicate(OnDuplicate::KeepEarlierDue);
    assert!(jobs::enqueue(&mut conn, &now).unwrap().updated);
    let due = jobs::get(&mut conn, c).unwrap().unwrap().due_at;
    assert!(
        due <= tenure::database_now(&mut conn).unwrap(),
        "due now: {due}"
    );
    assert_eq!(jobs::claim(&mut conn, "e", 10, TTL).unwrap().len(), 1);
}

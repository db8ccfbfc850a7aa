//! Uniqueness over time: dedup windows over finished jobs, their race, and retention that
//! keeps a window honest; the Replace and KeepEarlierDue modes for a live duplicate in a file
//! of their own.

mod crossings;
mod modes;

use std::time::Duration;

use chrono::{DateTime, Utc};
use tenure::jobs::{
    self, DedupOver, Enqueued, Finished, JobArgs, JobFilter, NewJob, OnDuplicate, Retention, Retry,
};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, contest, count};

conformance!(
    a_duplicate_folds_into_its_finished_twin_within_the_window_only,
    completed_only_or_any_final_state,
    a_live_twin_comes_before_a_finished_one,
    the_window_race_never_makes_two_jobs,
    prune_keeps_a_finished_job_until_its_window_is_over,
    bad_windows_and_modes_are_refused_and_write_nothing,
    enqueue_many_and_typed_jobs_honour_windows_and_modes,
);

const TTL: Duration = Duration::from_secs(60);

fn keyed(queue: &str, key: &str, payload: &str) -> NewJob {
    NewJob::new(queue, "k", payload.as_bytes().to_vec()).dedup_key(key)
}

/// Runs the only waiting job of `queue` to completion and returns its finish time.
fn complete_one(conn: &mut AnyConnection, queue: &str) -> DateTime<Utc> {
    let job = jobs::claim(conn, queue, 1, TTL).unwrap().remove(0);
    jobs::complete(conn, &[job.claim()]).unwrap();
    jobs::get(conn, job.id)
        .unwrap()
        .unwrap()
        .finished_at
        .expect("finished")
}

/// Waits until the database's clock is past `at` (never the client's: the clocks may differ).
fn wait_for_database_clock(conn: &mut AnyConnection, at: DateTime<Utc>) {
    while tenure::database_now(conn).unwrap() <= at {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn new_job(id: i64) -> Enqueued {
    Enqueued {
        id,
        existing: false,
        updated: false,
    }
}

fn folded(id: i64) -> Enqueued {
    Enqueued {
        id,
        existing: true,
        updated: false,
    }
}

/// The window is set from what the machine manages: 1 s, and when a loaded machine took
/// most of it between the finish and the duplicate (the precondition, read on the database's
/// clock), again on a fresh queue with a window four times as long.
fn a_duplicate_folds_into_its_finished_twin_within_the_window_only(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for (attempt, secs) in [1u64, 4, 16].into_iter().enumerate() {
        let window = Duration::from_secs(secs);
        let queue = format!("w{attempt}");
        let in_queue = |conn: &mut AnyConnection| {
            let filter = JobFilter {
                queue: Some(queue.clone()),
                ..JobFilter::default()
            };
            jobs::list(conn, &filter).unwrap().len()
        };
        let job = keyed(&queue, "evt", "1").dedup_window(window, DedupOver::Completed);
        let first = jobs::enqueue(&mut conn, &job).unwrap();
        let finished = complete_one(&mut conn, &queue);
        std::thread::sleep(Duration::from_millis(100));
        let again = jobs::enqueue(&mut conn, &job).unwrap();
        // The precondition, on the database clock: the duplicate came inside the window.
        let after = tenure::database_now(&mut conn).unwrap();
        let most = chrono::Duration::milliseconds(secs as i64 * 900);
        if after >= finished + most {
            eprintln!(
                "{backend:?}: {after} vs finished {finished}: a {secs} s window was too short here"
            );
            continue;
        }
        assert_eq!(again, folded(first.id), "folded into the finished twin");
        let twin = jobs::get(&mut conn, first.id).unwrap().unwrap();
        assert_eq!(twin.dedup_hits, 1);
        assert_eq!(twin.dedup_window_micros, Some(secs as i64 * 1_000_000));
        assert_eq!(in_queue(&mut conn), 1);

        // After the window (the database's clock says so, with a margin): a new job.
        let past = chrono::Duration::milliseconds(secs as i64 * 1000 + 100);
        wait_for_database_clock(&mut conn, finished + past);
        let later = jobs::enqueue(&mut conn, &job).unwrap();
        assert!(!later.existing, "{later:?}");
        assert_ne!(later.id, first.id);
        assert_eq!(in_queue(&mut conn), 2);
        return;
    }
    panic!("the machine stalled for most of a 16 s window");
}

fn completed_only_or_any_final_state(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let any = |key: &str| keyed("f", key, "x").dedup_window(TTL, DedupOver::AnyFinal);
    let completed = |key: &str| keyed("f", key, "x").dedup_window(TTL, DedupOver::Completed);

    // A dead twin: folds with AnyFinal, not with Completed.
    let dead = jobs::enqueue(&mut conn, &any("dead")).unwrap().id;
    let job = jobs::claim(&mut conn, "f", 1, TTL).unwrap().remove(0);
    jobs::fail(&mut conn, job.claim(), "broken", Retry::Never).unwrap();
    assert_eq!(
        jobs::enqueue(&mut conn, &any("dead")).unwrap(),
        folded(dead)
    );
    let fresh = jobs::enqueue(&mut conn, &completed("dead")).unwrap();
    assert!(!fresh.existing && fresh.id != dead, "{fresh:?}");
    jobs::cancel(&mut conn, fresh.id).unwrap();

    // A cancelled twin: the same.
    let cancelled = jobs::enqueue(&mut conn, &any("cancelled")).unwrap().id;
    assert!(jobs::cancel(&mut conn, cancelled).unwrap());
    assert_eq!(
        jobs::enqueue(&mut conn, &any("cancelled")).unwrap(),
        folded(cancelled)
    );
    let fresh = jobs::enqueue(&mut conn, &completed("cancelled")).unwrap();
    assert!(!fresh.existing && fresh.id != cancelled, "{fresh:?}");
    jobs::cancel(&mut conn, fresh.id).unwrap();

    // A completed twin folds with either.
    let done = jobs::enqueue(&mut conn, &completed("done")).unwrap().id;
    complete_one(&mut conn, "f");
    assert_eq!(
        jobs::enqueue(&mut conn, &completed("done")).unwrap(),
        folded(done)
    );
    assert_eq!(
        jobs::enqueue(&mut conn, &any("done")).unwrap(),
        folded(done)
    );
    assert_eq!(jobs::get(&mut conn, done).unwrap().unwrap().dedup_hits, 2);
    // A key of another queue, or without a window, is not covered.
    let other = NewJob::new("g", "k", vec![])
        .dedup_key("done")
        .dedup_window(TTL, DedupOver::AnyFinal);
    assert!(!jobs::enqueue(&mut conn, &other).unwrap().existing);
    assert!(
        !jobs::enqueue(&mut conn, &keyed("f", "done", "x"))
            .unwrap()
            .existing
    );
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 7);
}

/// With a live job and a finished one of the key inside the window, the live one takes the
/// duplicate (and its mode applies).
fn a_live_twin_comes_before_a_finished_one(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let finished = jobs::enqueue(&mut conn, &keyed("l", "k", "1")).unwrap().id;
    complete_one(&mut conn, "l");
    let live = jobs::enqueue(&mut conn, &keyed("l", "k", "2")).unwrap();
    assert!(!live.existing, "no window: a new job");
    let dup = keyed("l", "k", "3")
        .dedup_window(TTL, DedupOver::Completed)
        .on_duplicate(OnDuplicate::Replace);
    let again = jobs::enqueue(&mut conn, &dup).unwrap();
    assert_eq!(
        again,
        Enqueued {
            id: live.id,
            existing: true,
            updated: true
        }
    );
    assert_eq!(
        jobs::get(&mut conn, live.id).unwrap().unwrap().payload,
        b"3"
    );
    let twin = jobs::get(&mut conn, finished).unwrap().unwrap();
    assert_eq!(twin.dedup_hits, 0);
    // The live job takes the window too: once it finishes, the window covers it.
    assert_eq!(
        jobs::get(&mut conn, live.id)
            .unwrap()
            .unwrap()
            .dedup_window_micros,
        Some(TTL.as_micros() as i64)
    );
}

/// The twin completes while 7 threads enqueue its key (3 times each), every round on its
/// own key, 100 rounds: each enqueue folds into the twin, live or finished within the
/// window, so there is exactly one job per key and it counted 21 hits.
fn the_window_race_never_makes_two_jobs(backend: Backend) {
    const THREADS: usize = 8;
    const ROUNDS: usize = 100;
    const EACH: usize = 3;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let window = |round: usize| {
        keyed("race", &format!("r{round}"), &round.to_string())
            .dedup_window(TTL, DedupOver::Completed)
    };
    let batch: Vec<NewJob> = (0..ROUNDS).map(window).collect();
    let twins: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    let mut claims = jobs::claim(&mut conn, "race", ROUNDS, TTL).unwrap();
    claims.sort_by_key(|job| job.id);
    let claims: Vec<_> = claims.iter().map(|job| job.claim()).collect();
    assert_eq!(claims.iter().map(|c| c.id).collect::<Vec<_>>(), twins);
    let twins_for_check = twins.clone();
    let mut check = db.connect();
    let mut retried = 0;
    let mut folded_after_finish = 0;
    contest(
        &db,
        THREADS,
        ROUNDS,
        move |round, thread, conn| {
            // A deadlock (MySQL/MariaDB: the upsert's lock on the unique index entry against
            // the finish's update of it) is a retryable error: the call is repeated, as
            // callers (the worker's finisher) do.
            let mut retries = 0;
            let mut retry = |call: &mut dyn FnMut() -> tenure::Result<i64>| loop {
                match call() {
                    Err(e) if e.is_retryable() => retries += 1,
                    other => return other.map_err(|e| e.to_string()),
                }
            };
            let ids = if thread == 0 {
                retry(&mut || jobs::complete(conn, &[claims[round]]).map(|_| 0)).map(|_| Vec::new())
            } else {
                (0..EACH)
                    .map(|_| retry(&mut || jobs::enqueue(conn, &window(round)).map(|e| e.id)))
                    .collect::<Result<Vec<i64>, String>>()
            };
            (ids, retries)
        },
        |round, outcomes| {
            let twin = twins_for_check[round];
            retried += outcomes.iter().map(|(_, r)| r).sum::<usize>();
            let ids: Vec<i64> = outcomes
                .into_iter()
                .flat_map(|(ids, _)| ids.unwrap_or_else(|e| panic!("round {round}: {e}")))
                .collect();
            assert_eq!(ids.len(), (THREADS - 1) * EACH);
            assert!(
                ids.iter().all(|id| *id == twin),
                "round {round}: {ids:?} vs {twin}"
            );
            assert_eq!(
                count(
                    &mut check,
                    &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE dedup_key = 'r{round}'")
                ),
                1,
                "round {round}"
            );
            let job = jobs::get(&mut check, twin).unwrap().unwrap();
            assert_eq!(job.dedup_hits, ((THREADS - 1) * EACH) as i64);
            assert_eq!(job.state, jobs::JobState::Completed);
            folded_after_finish += 1;
        },
    );
    assert_eq!(folded_after_finish, ROUNDS);
    let mut conn = db.connect();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        ROUNDS as i64
    );
    println!(
        "{backend} window race: {ROUNDS} rounds, a completion against {} enqueues: one job \
         each ({retried} calls retried after a deadlock)",
        (THREADS - 1) * EACH
    );
}

fn prune_keeps_a_finished_job_until_its_window_is_over(backend: Backend) {
    const WINDOW: Duration = Duration::from_secs(3);
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = keyed("p", "w", "x").dedup_window(WINDOW, DedupOver::Completed);
    let twin = jobs::enqueue(&mut conn, &job).unwrap().id;
    let finished = complete_one(&mut conn, "p");
    jobs::enqueue(&mut conn, &keyed("p", "plain", "x")).unwrap();
    let plain_finished = complete_one(&mut conn, "p");
    // Retention shorter than the window: only the job without a window goes, whatever the
    // policy, even once the retention's age has passed for both.
    wait_for_database_clock(
        &mut conn,
        plain_finished + chrono::Duration::milliseconds(200),
    );
    assert!(
        tenure::database_now(&mut conn).unwrap() < finished + chrono::Duration::milliseconds(2500),
        "the machine stalled for most of the window"
    );
    let short = Retention::KeepYoungerThan(Duration::from_millis(100));
    assert_eq!(
        jobs::prune(&mut conn, "p", Finished::Completed, short, 100).unwrap(),
        1
    );
    assert_eq!(
        jobs::prune(
            &mut conn,
            "p",
            Finished::Completed,
            Retention::DeleteAll,
            100
        )
        .unwrap(),
        0
    );
    assert!(jobs::get(&mut conn, twin).unwrap().is_some());
    assert_eq!(jobs::enqueue(&mut conn, &job).unwrap(), folded(twin));
    // After the window, the policy applies.
    wait_for_database_clock(&mut conn, finished + chrono::Duration::milliseconds(3100));
    assert_eq!(
        jobs::prune(&mut conn, "p", Finished::Completed, short, 100).unwrap(),
        1
    );
    assert!(jobs::get(&mut conn, twin).unwrap().is_none());
    assert!(!jobs::enqueue(&mut conn, &job).unwrap().existing);
}

fn bad_windows_and_modes_are_refused_and_write_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let plain = || NewJob::new("b", "k", vec![]);
    let bad = [
        (
            "dedup_window",
            plain().dedup_window(TTL, DedupOver::Completed),
        ),
        ("on_duplicate", plain().on_duplicate(OnDuplicate::Replace)),
        (
            "on_duplicate",
            plain().on_duplicate(OnDuplicate::KeepEarlierDue),
        ),
        (
            "dedup_window",
            plain()
                .dedup_key("k")
                .dedup_window(Duration::ZERO, DedupOver::AnyFinal),
        ),
        (
            "dedup_window",
            plain()
                .dedup_key("k")
                .dedup_window(Duration::from_micros(999), DedupOver::AnyFinal),
        ),
        (
            "dedup_window",
            plain().dedup_key("k").dedup_window(
                tenure::MAX_TTL + Duration::from_secs(1),
                DedupOver::Completed,
            ),
        ),
    ];
    for (field, job) in &bad {
        match jobs::enqueue(&mut conn, job) {
            Err(tenure::Error::InvalidInput { field: f, .. }) => assert_eq!(f, *field, "{job:?}"),
            other => panic!("{job:?}: {other:?}"),
        }
        let batch = [keyed("b", "fine", "x"), job.clone()];
        assert!(
            jobs::enqueue_many(&mut conn, &batch)
                .unwrap_err()
                .is_invalid_input()
        );
    }
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    // The bounds themselves are fine.
    let edges = [Duration::from_millis(1), tenure::MAX_TTL];
    for (i, window) in edges.into_iter().enumerate() {
        let job = keyed("b", &i.to_string(), "x").dedup_window(window, DedupOver::AnyFinal);
        assert!(!jobs::enqueue(&mut conn, &job).unwrap().existing);
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Hook {
    event: String,
}

impl JobArgs for Hook {
    const KIND: &'static str = "hook";
    const QUEUE: &'static str = "hooks";
    const DEDUP_WINDOW: Option<(Duration, DedupOver)> = Some((TTL, DedupOver::Completed));
    const ON_DUPLICATE: OnDuplicate = OnDuplicate::Replace;
    fn dedup_key(&self) -> Option<String> {
        (!self.event.is_empty()).then(|| self.event.clone())
    }
}

fn enqueue_many_and_typed_jobs_honour_windows_and_modes(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // In one batch: the second of a key replaces the first's payload.
    let replace = |payload: &str| keyed("m", "x", payload).on_duplicate(OnDuplicate::Replace);
    let out = jobs::enqueue_many(
        &mut conn,
        &[replace("1"), NewJob::new("m", "k", vec![]), replace("2")],
    )
    .unwrap();
    assert_eq!(out[0], new_job(out[0].id));
    assert!(!out[1].existing);
    assert_eq!(
        out[2],
        Enqueued {
            id: out[0].id,
            existing: true,
            updated: true
        }
    );
    assert_eq!(
        jobs::get(&mut conn, out[0].id).unwrap().unwrap().payload,
        b"2"
    );
    // A batch folds into a twin finished within its window.
    let claimed = jobs::claim(&mut conn, "m", 10, TTL).unwrap();
    jobs::complete(
        &mut conn,
        &claimed.iter().map(|j| j.claim()).collect::<Vec<_>>(),
    )
    .unwrap();
    let windowed = keyed("m", "x", "3").dedup_window(TTL, DedupOver::Completed);
    let again = jobs::enqueue_many(&mut conn, &[windowed.clone(), windowed]).unwrap();
    assert_eq!(again, vec![folded(out[0].id), folded(out[0].id)]);

    // Typed: the type's window and mode apply to values with a key, and only to those.
    let first = jobs::enqueue_job(&mut conn, &Hook { event: "e1".into() }).unwrap();
    let job = jobs::get(&mut conn, first.id).unwrap().unwrap();
    assert_eq!(job.dedup_window_micros, Some(TTL.as_micros() as i64));
    complete_one(&mut conn, "hooks");
    assert_eq!(
        jobs::enqueue_job(&mut conn, &Hook { event: "e1".into() }).unwrap(),
        folded(first.id)
    );
    let keyless = jobs::enqueue_jobs(
        &mut conn,
        &[Hook { event: "".into() }, Hook { event: "".into() }],
    )
    .unwrap();
    assert!(keyless.iter().all(|e| !e.existing));
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 5);
}

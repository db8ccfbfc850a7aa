//! Dedup windows crossed with other features: a schedule's jobs' window, Replace across kinds,
//! and a prune against a window folding in a transaction.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, DedupOver, NewJob, OnDuplicate};
use tenure::schedules::{self, Schedule};

use crate::common::{TestDb, conformance, count, poll_until, wait_for_db_clock};

conformance!(
    a_schedule_never_drops_its_jobs_dedup_window_silently,
    replace_never_gives_a_job_the_payload_meant_for_another_kind,
    a_prune_against_window_folds_in_a_transaction_never_hangs_or_deletes_a_folded_twin,
);

const TTL: Duration = Duration::from_secs(600);

/// A schedule's job with a dedup key and a one-hour window over completed jobs. `upsert`
/// refuses what a schedule cannot keep (a rate limit, a second limit, a fixed due time) with
/// `InvalidInput`; the window and the mode it accepts and then drops: the next tick, a
/// second after the first tick's job completed, makes a second job of the key inside the
/// window (the stored schedule has no window; `Schedule::job` rebuilds the job without it).
/// Either refusing at `upsert` or honouring the window passes.
fn a_schedule_never_drops_its_jobs_dedup_window_silently(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = NewJob::new("sched", "k", b"p".to_vec())
        .dedup_key("nightly")
        .dedup_window(Duration::from_secs(3600), DedupOver::Completed)
        .on_duplicate(OnDuplicate::Replace);
    let schedule = Schedule::every("s", Duration::from_millis(200), job);
    match schedules::upsert(&mut conn, &schedule) {
        Err(e) if e.is_invalid_input() => {
            assert!(
                schedules::list(&mut conn).unwrap().is_empty(),
                "refused but written"
            );
            return;
        }
        Err(e) => panic!("upsert: {e}"),
        Ok(()) => {}
    }
    let next = schedules::list(&mut conn).unwrap()[0].next_due_at;
    wait_for_db_clock(&mut conn, next);
    assert_eq!(schedules::tick(&mut conn).unwrap(), 1);
    let claimed = jobs::claim(&mut conn, "sched", 1, TTL).unwrap();
    assert_eq!(claimed.len(), 1);
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    // The next tick, inside the hour.
    let next = schedules::list(&mut conn).unwrap()[0].next_due_at;
    wait_for_db_clock(&mut conn, next);
    let fired = schedules::tick(&mut conn).unwrap();
    let jobs_of_key = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE dedup_key = 'nightly'",
    );
    assert_eq!(
        (fired, jobs_of_key),
        (0, 1),
        "{backend}: a tick inside the schedule job's one-hour window made another job of its key"
    );
}

/// Two kinds share a queue and a key space (typed jobs all default to the queue "default";
/// keys such as a user id). Kind "b" enqueued with Replace while a waiting job of kind "a"
/// has the key: the answer is `updated: true`, and the job of kind "a" now carries the
/// payload given for kind "b" (its handler gets another kind's arguments). A job's kind and
/// payload must come from one enqueue: either the mode leaves another kind's job alone, or
/// it replaces the kind too.
fn replace_never_gives_a_job_the_payload_meant_for_another_kind(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let first = jobs::enqueue(
        &mut conn,
        &NewJob::new("default", "resize_image", b"{\"image\":7}".to_vec())
            .dedup_key("user-7")
            .delay(Duration::from_secs(60)),
    )
    .unwrap();
    let second = jobs::enqueue(
        &mut conn,
        &NewJob::new("default", "send_email", b"{\"to\":\"a@b\"}".to_vec())
            .dedup_key("user-7")
            .on_duplicate(OnDuplicate::Replace),
    )
    .unwrap();
    assert_eq!(second.id, first.id);
    let job = jobs::get(&mut conn, first.id).unwrap().unwrap();
    let pair = (job.kind.as_str(), job.payload.as_slice());
    assert!(
        pair == ("resize_image", &b"{\"image\":7}"[..])
            || pair == ("send_email", &b"{\"to\":\"a@b\"}"[..]),
        "{backend}: kind {:?} with payload {:?} (answer {second:?})",
        job.kind,
        String::from_utf8_lossy(&job.payload)
    );
}

/// Waits until the pruner waits in its statement that locks the picked rows, or has
/// returned from its first call (it skipped what it could not lock) (60 s at most).
fn wait_for_a_lock_wait(
    conn: &mut tenure::AnyConnection,
    backend: Backend,
    pruned: &std::sync::atomic::AtomicBool,
) {
    let sql = match backend {
        Backend::Postgres => {
            "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database()"
        }
        // MariaDB lists a transaction waiting in a locking read nowhere in INNODB_TRX: the
        // pruner's statement that locks the picked rows, running, is what is looked for (it
        // stays there while the enqueuer holds X2).
        Backend::Mysql => {
            "SELECT CAST(COUNT(*) AS SIGNED) AS n FROM information_schema.PROCESSLIST \
             WHERE DB = DATABASE() AND INFO LIKE 'SELECT id, state FROM tenure_jobs WHERE (dedup_window%'"
        }
        Backend::Sqlite => {
            // No row locks: the pruner waits for the write lock; give it time to start.
            std::thread::sleep(Duration::from_millis(300));
            return;
        }
    };
    poll_until(Duration::from_secs(60), Duration::from_millis(20), || {
        (count(conn, sql) > 0 || pruned.load(std::sync::atomic::Ordering::SeqCst)).then_some(())
    })
    .expect("the pruner never waited for a lock");
}

/// Two finished keyed jobs without a window (X1, then X2: enqueued with a key alone). A
/// caller's `tenure::transaction` enqueues with a one-hour window over any final state, key
/// of X2 first (folding into X2, holding its lock), then key of X1. Between the two, a
/// pruner (DeleteAll) picks both (no window recorded yet: NULL) and locks them by id in
/// `LOCK_PICKED`: X1 locked, waiting for X2. The second fold waits for X1: a deadlock.
/// A deadlock is retryable; what must not happen: a hang (the pruner's locking read that
/// fetches rows is the statement reported mid-fetch), an error that is not retryable, or
/// a prune that deletes a twin a committed enqueue folded into.
///
/// Found: MariaDB reports the deadlock to the pruner in the middle of `LOCK_PICKED`'s rows
/// (X1 sent, X2 waited for); that call fails (retryable), and the pruner's connection hangs
/// for good on its next prune (the server shows it idle: the client waits for a reply that
/// never comes). PostgreSQL and SQLite pass.
fn a_prune_against_window_folds_in_a_transaction_never_hangs_or_deletes_a_folded_twin(
    backend: Backend,
) {
    const ROUNDS: usize = 4;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut watcher = db.connect();
    let mut pruner = Some(db.connect());
    let mut enqueuer = db.connect();
    let mut outcomes = Vec::new();
    for round in 0..ROUNDS {
        let queue = format!("p{round}");
        let (k1, k2) = (format!("a{round}"), format!("b{round}"));
        for key in [&k1, &k2] {
            jobs::enqueue(
                &mut conn,
                &NewJob::new(queue.as_str(), "k", vec![]).dedup_key(key.as_str()),
            )
            .unwrap();
        }
        let claimed = jobs::claim(&mut conn, &queue, 2, TTL).unwrap();
        let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
        jobs::complete(&mut conn, &claims).unwrap();
        let mut ids: Vec<i64> = claimed.iter().map(|j| j.id).collect();
        ids.sort_unstable();
        let window = |key: &str| {
            NewJob::new(queue.as_str(), "k", vec![])
                .dedup_key(key)
                .dedup_window(Duration::from_secs(3600), DedupOver::AnyFinal)
        };
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let pruned = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pruned_flag = pruned.clone();
        let mut p = pruner.take().expect("the pruner came back");
        let prune_queue = queue.clone();
        std::thread::spawn(move || {
            started_rx.recv().unwrap();
            let first = jobs::prune(
                &mut p,
                &prune_queue,
                jobs::Finished::Completed,
                jobs::Retention::DeleteAll,
                100,
            );
            pruned_flag.store(true, std::sync::atomic::Ordering::SeqCst);
            // The same statements again, on the same connection.
            let second = jobs::prune(
                &mut p,
                &prune_queue,
                jobs::Finished::Completed,
                jobs::Retention::DeleteAll,
                100,
            );
            let _ = done_tx.send((
                first.map_err(|e| (e.is_retryable(), e.to_string())),
                second.map_err(|e| (e.is_retryable(), e.to_string())),
                p,
            ));
        });
        let folded: Result<(jobs::Enqueued, jobs::Enqueued), tenure::Error> =
            tenure::transaction(&mut enqueuer, |c| {
                let second = jobs::enqueue(c, &window(&k2))?;
                started_tx.send(()).unwrap();
                wait_for_a_lock_wait(&mut watcher, backend, &pruned);
                let first = jobs::enqueue(c, &window(&k1))?;
                Ok((first, second))
            });
        let (first_prune, second_prune, p) = done_rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                panic!("{backend} round {round}: the pruner hung (enqueue: {folded:?})")
            });
        pruner = Some(p);
        if let Err(e) = &folded {
            assert!(
                e.is_retryable(),
                "{backend} round {round}: enqueue failed with {e}"
            );
        }
        for prune in [&first_prune, &second_prune] {
            if let Err((retryable, e)) = prune {
                assert!(retryable, "{backend} round {round}: prune failed with {e}");
            }
        }
        let left = count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{queue}'"),
        );
        let exists =
            |conn: &mut tenure::AnyConnection, id: i64| jobs::get(conn, id).unwrap().is_some();
        if let Ok((first, second)) = folded {
            // X2 was folded into (the window widened) before the prune began: it stays.
            assert_eq!(
                (second.id, second.existing),
                (ids[1], true),
                "{backend} round {round}"
            );
            assert!(
                exists(&mut conn, ids[1]),
                "{backend} round {round}: a prune deleted a twin a committed enqueue folded into"
            );
            // X1 (no window of its own) was folded into, or pruned first and a new job made.
            if first.existing {
                assert_eq!(first.id, ids[0], "{backend} round {round}");
                assert!(
                    exists(&mut conn, ids[0]),
                    "{backend} round {round}: a prune deleted a twin a committed enqueue folded into"
                );
            } else {
                assert!(
                    !exists(&mut conn, ids[0]),
                    "{backend} round {round}: a new job beside its twin"
                );
            }
        }
        outcomes.push((
            folded.is_ok(),
            first_prune.is_ok(),
            second_prune.is_ok(),
            left,
        ));
    }
    println!(
        "{backend}: (enqueue ok, prune ok, prune again ok, jobs left) per round: {outcomes:?}"
    );
}

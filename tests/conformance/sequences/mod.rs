//! Strict order per key (sequences, [`NewJob::sequence`]): the jobs of a key run one at a time,
//! in the order they were enqueued; a retrying job holds the rest back; a dead or cancelled
//! one holds them until it is retried and completes or an operator lets them go on (or, with
//! `SequenceFailure::Continue`, they go on). The negative control shows today's
//! `limit(key, 1)` letting a job overtake one that retries.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod edges;

use tenure::Backend;
use tenure::jobs::{self, Finished, JobState, Limit, NewJob, Retention, Retry, SequenceFailure};

use crate::common::{TestDb, conformance, enqueue_id, job_state};

conformance!(
    eight_claimers_with_retries_run_each_key_in_enqueue_order,
    negative_control_a_limit_of_one_lets_a_job_overtake_one_that_retries,
    a_dead_job_holds_its_sequence_until_retried_or_skipped,
    with_continue_the_rest_go_on_past_a_dead_job,
    a_job_enqueued_after_its_predecessor_died_waits_only_when_held,
    a_cancelled_job_holds_its_sequence,
    a_bulk_enqueue_keeps_the_order_within_each_key,
    retention_keeps_a_dead_job_while_it_holds_its_sequence,
    bad_sequence_input_is_refused_and_changes_nothing,
);

const TTL: Duration = Duration::from_secs(600);
const KEYS: usize = 12;
const PER_KEY: usize = 15;
const CLAIMERS: usize = 8;

/// Enqueues `PER_KEY` jobs on each of `KEYS` keys from two threads, each key's jobs from one
/// thread in turn (keys interleaved), made by `make(key)`; returns each key's ids in the order
/// enqueued.
fn enqueue_keys(db: &TestDb, make: fn(&str) -> NewJob) -> HashMap<String, VecDeque<i64>> {
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let mut conn = db.connect();
            std::thread::spawn(move || {
                let mut mine: Vec<(String, i64)> = Vec::new();
                for i in 0..PER_KEY {
                    for k in (t..KEYS).step_by(2) {
                        let key = format!("k{k}");
                        let _ = i;
                        mine.push((key.clone(), enqueue_id(&mut conn, make(&key))));
                    }
                }
                mine
            })
        })
        .collect();
    let mut order: HashMap<String, VecDeque<i64>> = HashMap::new();
    for thread in threads {
        for (key, id) in thread.join().unwrap() {
            order.entry(key).or_default().push_back(id);
        }
    }
    order
}

/// Eight claimers on their own connections claim one job at a time; a job whose id is a
/// multiple of 3 fails its first run (retried at once). Every claim is checked against its
/// key's first job not yet completed: a claim of any other is an overtaking. Returns the
/// overtakings seen and the runs made.
fn run_keys(
    db: &TestDb,
    order: HashMap<String, VecDeque<i64>>,
    key_of: HashMap<i64, String>,
) -> (Vec<String>, usize) {
    let total: usize = order.values().map(VecDeque::len).sum();
    let order = Arc::new(Mutex::new(order));
    let key_of = Arc::new(key_of);
    let completed = Arc::new(AtomicUsize::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let overtakings = Arc::new(Mutex::new(Vec::new()));
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let (mut c, order, key_of, completed, runs, overtakings) = (
                db.connect(),
                order.clone(),
                key_of.clone(),
                completed.clone(),
                runs.clone(),
                overtakings.clone(),
            );
            std::thread::spawn(move || {
                let mut idle = 0;
                while completed.load(Ordering::SeqCst) < total && idle < 2_000 {
                    let claimed = jobs::claim(&mut c, "q", 1, TTL).unwrap();
                    let Some(job) = claimed.first() else {
                        idle += 1;
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    idle = 0;
                    runs.fetch_add(1, Ordering::SeqCst);
                    let key = &key_of[&job.id];
                    let fails = job.id % 3 == 0 && job.attempt == 1;
                    {
                        let mut order = order.lock().unwrap();
                        let queue = order.get_mut(key).unwrap();
                        if queue.front() != Some(&job.id) {
                            overtakings.lock().unwrap().push(format!(
                                "{key}: job {} claimed while {:?} had not completed",
                                job.id,
                                queue.front()
                            ));
                        }
                        // The run ends here (before the finish commits and releases the next).
                        if !fails {
                            queue.retain(|id| *id != job.id);
                        }
                    }
                    if fails {
                        jobs::fail(
                            &mut c,
                            job.claim(),
                            "first run fails",
                            Retry::After(Duration::ZERO),
                        )
                        .unwrap();
                    } else {
                        jobs::complete(&mut c, &[job.claim()]).unwrap();
                        completed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for claimer in claimers {
        claimer.join().unwrap();
    }
    let overtakings = std::mem::take(&mut *overtakings.lock().unwrap());
    assert_eq!(
        completed.load(Ordering::SeqCst),
        total,
        "not every job completed (overtakings: {overtakings:?})"
    );
    (overtakings, runs.load(Ordering::SeqCst))
}

fn key_index(order: &HashMap<String, VecDeque<i64>>) -> HashMap<i64, String> {
    order
        .iter()
        .flat_map(|(key, ids)| ids.iter().map(move |id| (*id, key.clone())))
        .collect()
}

/// 12 keys of 15 jobs, enqueued by two threads; eight claimers, a third of the jobs failing
/// their first run: no job is claimed before every job enqueued before it on its key has
/// completed, and every job completes.
fn eight_claimers_with_retries_run_each_key_in_enqueue_order(backend: Backend) {
    let db = TestDb::migrated(backend);
    let order = enqueue_keys(&db, |key| NewJob::new("q", "s", vec![]).sequence(key));
    let keys = key_index(&order);
    let (overtakings, runs) = run_keys(&db, order, keys);
    assert!(overtakings.is_empty(), "{overtakings:#?}");
    assert!(
        runs > KEYS * PER_KEY,
        "no run failed: the retries were not exercised"
    );
}

/// The same with `limit(key, 1)` and no sequence: one at a time, but a job that retries is
/// overtaken by the next of its key (its retry is due later than the next job is).
fn negative_control_a_limit_of_one_lets_a_job_overtake_one_that_retries(backend: Backend) {
    let db = TestDb::migrated(backend);
    let order = enqueue_keys(&db, |key| {
        NewJob::new("q", "s", vec![]).with_limit(Limit::concurrency(key, 1))
    });
    let keys = key_index(&order);
    let (overtakings, _) = run_keys(&db, order, keys);
    assert!(
        !overtakings.is_empty(),
        "a limit of one kept the order: the control shows nothing"
    );
}

fn claim_only(conn: &mut tenure::AnyConnection) -> jobs::ClaimedJob {
    let claimed = jobs::claim(conn, "q", 10, TTL).unwrap();
    assert_eq!(claimed.len(), 1, "claimed {claimed:?}");
    claimed.into_iter().next().unwrap()
}

/// a, b, c on one key (held by default). a dies: b and c stay blocked; `retry_dead(a)` runs
/// it again and its completion releases b; b dies, and `skip_in_sequence(b)` lets c go on.
fn a_dead_job_holds_its_sequence_until_retried_or_skipped(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("q", "s", vec![]).sequence("k");
    let (a, b, c) = (
        enqueue_id(&mut conn, job()),
        enqueue_id(&mut conn, job()),
        enqueue_id(&mut conn, job()),
    );
    let run = claim_only(&mut conn);
    assert_eq!(run.id, a);
    jobs::fail(&mut conn, run.claim(), "broken", Retry::Never).unwrap();
    assert_eq!(job_state(&mut conn, a), JobState::Dead);
    assert!(
        jobs::claim(&mut conn, "q", 10, TTL).unwrap().is_empty(),
        "the sequence went on past a dead job"
    );
    assert_eq!(job_state(&mut conn, b), JobState::Blocked);
    assert!(jobs::retry_dead(&mut conn, a).unwrap());
    let run = claim_only(&mut conn);
    assert_eq!(run.id, a, "b ran before the retried a");
    jobs::complete(&mut conn, &[run.claim()]).unwrap();
    let run = claim_only(&mut conn);
    assert_eq!(run.id, b);
    jobs::fail(&mut conn, run.claim(), "broken too", Retry::Never).unwrap();
    assert_eq!(job_state(&mut conn, c), JobState::Blocked);
    // Letting a live or completed job go changes nothing.
    assert_eq!(jobs::skip_in_sequence(&mut conn, a).unwrap(), 0);
    assert_eq!(jobs::skip_in_sequence(&mut conn, c).unwrap(), 0);
    assert_eq!(jobs::skip_in_sequence(&mut conn, 999_999).unwrap(), 0);
    assert_eq!(job_state(&mut conn, c), JobState::Blocked);
    assert_eq!(jobs::skip_in_sequence(&mut conn, b).unwrap(), 1);
    assert_eq!(
        jobs::skip_in_sequence(&mut conn, b).unwrap(),
        0,
        "let go twice"
    );
    let run = claim_only(&mut conn);
    assert_eq!(run.id, c);
    jobs::complete(&mut conn, &[run.claim()]).unwrap();
    assert_eq!(job_state(&mut conn, b), JobState::Dead);
}

/// With `SequenceFailure::Continue`, a's death releases b at once.
fn with_continue_the_rest_go_on_past_a_dead_job(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || {
        NewJob::new("q", "s", vec![])
            .sequence("k")
            .sequence_failure(SequenceFailure::Continue)
    };
    let (a, b) = (enqueue_id(&mut conn, job()), enqueue_id(&mut conn, job()));
    assert_eq!(job_state(&mut conn, b), JobState::Blocked);
    let run = claim_only(&mut conn);
    assert_eq!(run.id, a);
    jobs::fail(&mut conn, run.claim(), "broken", Retry::Never).unwrap();
    let run = claim_only(&mut conn);
    assert_eq!(run.id, b);
}

/// A job enqueued after the key's last job died waits for it when held, not otherwise; one
/// enqueued after the last completed, or after it was pruned, runs at once.
fn a_job_enqueued_after_its_predecessor_died_waits_only_when_held(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k"));
    let run = claim_only(&mut conn);
    jobs::fail(&mut conn, run.claim(), "broken", Retry::Never).unwrap();
    let held = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k"));
    assert_eq!(job_state(&mut conn, held), JobState::Blocked);
    assert_eq!(jobs::skip_in_sequence(&mut conn, a).unwrap(), 1);
    let run = claim_only(&mut conn);
    assert_eq!(run.id, held);
    jobs::fail(&mut conn, run.claim(), "broken", Retry::Never).unwrap();
    let going_on = enqueue_id(
        &mut conn,
        NewJob::new("q", "s", vec![])
            .sequence("k")
            .sequence_failure(SequenceFailure::Continue),
    );
    assert_eq!(job_state(&mut conn, going_on), JobState::Waiting);
    let run = claim_only(&mut conn);
    jobs::complete(&mut conn, &[run.claim()]).unwrap();
    let after_completed = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k"));
    assert_eq!(job_state(&mut conn, after_completed), JobState::Waiting);
    let run = claim_only(&mut conn);
    jobs::complete(&mut conn, &[run.claim()]).unwrap();
    jobs::prune(
        &mut conn,
        "q",
        Finished::Completed,
        Retention::DeleteAll,
        100,
    )
    .unwrap();
    let after_pruned = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k"));
    assert_eq!(job_state(&mut conn, after_pruned), JobState::Waiting);
}

/// An operator's cancel of a waiting job holds the rest (held by default) until let go.
fn a_cancelled_job_holds_its_sequence(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("q", "s", vec![]).sequence("k");
    let (a, b) = (enqueue_id(&mut conn, job()), enqueue_id(&mut conn, job()));
    assert!(jobs::cancel(&mut conn, a).unwrap());
    assert!(jobs::claim(&mut conn, "q", 10, TTL).unwrap().is_empty());
    assert_eq!(jobs::skip_in_sequence(&mut conn, a).unwrap(), 1);
    assert_eq!(claim_only(&mut conn).id, b);
}

/// One bulk enqueue of three keys' jobs, interleaved, after a job of one key already waits:
/// each key's jobs are claimed in the batch's order, the waiting one first.
fn a_bulk_enqueue_keeps_the_order_within_each_key(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let before = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k0"));
    let batch: Vec<NewJob> = (0..30)
        .map(|i| NewJob::new("q", "s", vec![i as u8]).sequence(format!("k{}", i % 3)))
        .collect();
    let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    let mut expected: HashMap<String, VecDeque<i64>> = HashMap::new();
    expected.entry("k0".into()).or_default().push_back(before);
    for (i, id) in ids.iter().enumerate() {
        expected
            .entry(format!("k{}", i % 3))
            .or_default()
            .push_back(*id);
    }
    let key_of = key_index(&expected);
    for _ in 0..31 {
        let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
        assert!(
            claimed.len() <= 3,
            "more than one job of a key at once: {claimed:?}"
        );
        for job in &claimed {
            let queue = expected.get_mut(&key_of[&job.id]).unwrap();
            assert_eq!(queue.pop_front(), Some(job.id), "out of order");
        }
        let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
        if claims.is_empty() {
            break;
        }
        jobs::complete(&mut conn, &claims).unwrap();
    }
    assert!(
        expected.values().all(VecDeque::is_empty),
        "left: {expected:?}"
    );
}

/// A dead job that holds its sequence is not pruned (the job after it waits for it); once
/// let go, it may be.
fn retention_keeps_a_dead_job_while_it_holds_its_sequence(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = || NewJob::new("q", "s", vec![]).sequence("k");
    let (a, _b) = (enqueue_id(&mut conn, job()), enqueue_id(&mut conn, job()));
    let run = claim_only(&mut conn);
    jobs::fail(&mut conn, run.claim(), "broken", Retry::Never).unwrap();
    assert_eq!(
        jobs::prune(&mut conn, "q", Finished::Dead, Retention::DeleteAll, 100).unwrap(),
        0
    );
    assert_eq!(job_state(&mut conn, a), JobState::Dead);
    assert_eq!(jobs::skip_in_sequence(&mut conn, a).unwrap(), 1);
    let run = claim_only(&mut conn);
    jobs::complete(&mut conn, &[run.claim()]).unwrap();
    assert_eq!(
        jobs::prune(&mut conn, "q", Finished::Dead, Retention::DeleteAll, 100).unwrap(),
        1
    );
}

/// An empty, over-long or NUL-holding key, a sequence with dependencies or a dedup key, a
/// failure mode without a key, and a sequence where it would be dropped (a schedule's job, a
/// parked enqueue) are typed errors that write nothing, alone or in a batch.
fn bad_sequence_input_is_refused_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let other = enqueue_id(&mut conn, NewJob::new("other", "s", vec![]));
    let bad = [
        NewJob::new("q", "s", vec![]).sequence(""),
        NewJob::new("q", "s", vec![]).sequence("k".repeat(256)),
        NewJob::new("q", "s", vec![]).sequence("a\0b"),
        NewJob::new("q", "s", vec![])
            .sequence("k")
            .depends_on([other]),
        NewJob::new("q", "s", vec![]).sequence("k").dedup_key("d"),
        NewJob::new("q", "s", vec![]).sequence_failure(SequenceFailure::Continue),
    ];
    for job in &bad {
        let outcome = jobs::enqueue(&mut conn, job);
        assert!(
            matches!(outcome, Err(tenure::Error::InvalidInput { .. })),
            "{job:?}: {outcome:?}"
        );
        let good = NewJob::new("q", "s", vec![]).sequence("k");
        let outcome = jobs::enqueue_many(&mut conn, &[good, job.clone()]);
        assert!(
            matches!(outcome, Err(tenure::Error::InvalidInput { .. })),
            "{job:?}: {outcome:?}"
        );
    }
    // Where a sequence would be dropped, it is refused: a schedule's job, a parked enqueue.
    let schedule = tenure::schedules::Schedule::every(
        "s",
        Duration::from_secs(60),
        NewJob::new("q", "s", vec![]).sequence("k"),
    );
    assert!(matches!(
        tenure::schedules::upsert(&mut conn, &schedule),
        Err(tenure::Error::InvalidInput { .. })
    ));
    assert!(matches!(
        jobs::enqueue_parked(
            &mut conn,
            &NewJob::new("q", "s", vec![]).sequence("k"),
            Duration::from_secs(60)
        ),
        Err(tenure::Error::InvalidInput { .. })
    ));
    assert!(jobs::claim(&mut conn, "q", 10, TTL).unwrap().is_empty());
    assert_eq!(
        crate::common::count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_sequences"),
        0
    );
    assert_eq!(
        crate::common::count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_schedules"),
        0
    );
}

//! A sequence's order at its edges: a job cancelled while it waited in the middle of its
//! sequence (taken out of it, with `Continue` and after a skip), a dead head never overtaken,
//! many threads enqueueing one key, an enqueue rolled back or made under a caller's
//! REPEATABLE READ snapshot, batches taking keys in opposite orders, enqueues racing
//! completions and deaths, and batches or workflows refused whole.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob, SequenceFailure};

use crate::common::{TestDb, conformance, enqueue_id, job_state};

conformance!(
    with_continue_a_cancel_of_a_blocked_middle_job_keeps_the_next_waiting_for_the_head,
    with_continue_an_enqueue_after_a_cancelled_blocked_job_waits_for_the_head,
    skipping_a_cancelled_blocked_middle_job_keeps_the_next_waiting_for_the_head,
    skipping_a_cancelled_blocked_middle_job_never_lets_the_rest_overtake_a_dead_head,
    many_threads_enqueueing_one_key_make_one_chain_run_in_commit_order,
    a_rolled_back_enqueue_leaves_the_key_to_the_job_before_it,
    two_batches_taking_keys_in_opposite_orders_both_commit,
    enqueues_racing_completions_and_deaths_lose_nothing_and_keep_order,
    a_workflow_step_with_a_sequence_and_dependencies_is_refused_and_writes_nothing,
    an_enqueue_in_a_callers_repeatable_read_snapshot_chains_after_the_newest_job,
    a_batch_failing_after_its_sequenced_jobs_writes_nothing,
);

const TTL: Duration = Duration::from_secs(600);

fn job(failure: SequenceFailure) -> NewJob {
    NewJob::new("q", "s", vec![])
        .sequence("k")
        .sequence_failure(failure)
}

fn claim_ids(conn: &mut tenure::AnyConnection) -> Vec<i64> {
    jobs::claim(conn, "q", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect()
}

/// Found by attack (c ran beside a): a, b, c on one key with `Continue`; a is running. An
/// operator cancels b, still blocked behind a: b never ran, a has not finished, so c must
/// still wait, now for a (b is taken out of the sequence).
fn with_continue_a_cancel_of_a_blocked_middle_job_keeps_the_next_waiting_for_the_head(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let f = SequenceFailure::Continue;
    let (a, b, c) = (
        enqueue_id(&mut conn, job(f)),
        enqueue_id(&mut conn, job(f)),
        enqueue_id(&mut conn, job(f)),
    );
    assert_eq!(claim_ids(&mut conn), vec![a]);
    assert!(jobs::cancel(&mut conn, b).unwrap());
    assert_eq!(
        job_state(&mut conn, c),
        JobState::Blocked,
        "c released while a (enqueued before it) is still running"
    );
    assert!(
        claim_ids(&mut conn).is_empty(),
        "two jobs of one key running at once"
    );
}

/// Found by attack (c was claimed before a): a, b with `Continue`; a waits, b (blocked
/// behind a) is cancelled. A job c enqueued now waits for a, which has not run (the key's
/// last is a again).
fn with_continue_an_enqueue_after_a_cancelled_blocked_job_waits_for_the_head(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let f = SequenceFailure::Continue;
    let (a, b) = (enqueue_id(&mut conn, job(f)), enqueue_id(&mut conn, job(f)));
    assert!(jobs::cancel(&mut conn, b).unwrap());
    let c = enqueue_id(&mut conn, job(f));
    assert_eq!(
        job_state(&mut conn, c),
        JobState::Blocked,
        "c enqueued after a, which has not run, waits for nothing"
    );
    assert_eq!(claim_ids(&mut conn), vec![a]);
}

/// Found by attack (c ran beside a): a, b, c held (the default); a is running, b (blocked)
/// is cancelled, and the operator lets b go (`skip_in_sequence(b)`). b was taken out of the
/// sequence when cancelled, so it holds nothing: c still waits for a.
fn skipping_a_cancelled_blocked_middle_job_keeps_the_next_waiting_for_the_head(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let f = SequenceFailure::Hold;
    let (a, b, c) = (
        enqueue_id(&mut conn, job(f)),
        enqueue_id(&mut conn, job(f)),
        enqueue_id(&mut conn, job(f)),
    );
    assert_eq!(claim_ids(&mut conn), vec![a]);
    assert!(jobs::cancel(&mut conn, b).unwrap());
    jobs::skip_in_sequence(&mut conn, b).unwrap();
    assert_eq!(
        job_state(&mut conn, c),
        JobState::Blocked,
        "c released while a (enqueued before it) is still running"
    );
    assert!(
        claim_ids(&mut conn).is_empty(),
        "two jobs of one key running at once"
    );
}

/// Found by attack (c ran before the dead a was dealt with): a, b, c held; a dies. The
/// operator cancels b and lets b go: a still holds the rest until it is retried and
/// completes or is skipped itself.
fn skipping_a_cancelled_blocked_middle_job_never_lets_the_rest_overtake_a_dead_head(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let f = SequenceFailure::Hold;
    let (a, b, c) = (
        enqueue_id(&mut conn, job(f)),
        enqueue_id(&mut conn, job(f)),
        enqueue_id(&mut conn, job(f)),
    );
    let run = jobs::claim(&mut conn, "q", 10, TTL).unwrap().remove(0);
    assert_eq!(run.id, a);
    jobs::fail(&mut conn, run.claim(), "broken", jobs::Retry::Never).unwrap();
    assert_eq!(job_state(&mut conn, a), JobState::Dead);
    assert!(jobs::cancel(&mut conn, b).unwrap());
    jobs::skip_in_sequence(&mut conn, b).unwrap();
    let claimed = claim_ids(&mut conn);
    assert!(
        claimed.is_empty(),
        "claimed {claimed:?} (c = {c}) while a, dead, was neither retried nor skipped"
    );
}

/// Eight threads enqueue 25 jobs each on one key at once (each on its own connection), two
/// of them inside their own transactions that commit. The key's jobs form one chain in
/// commit order: each but the first waits for exactly one, no two wait for the same, and
/// claimers see them one at a time in that order, every one completing.
fn many_threads_enqueueing_one_key_make_one_chain_run_in_commit_order(backend: Backend) {
    const THREADS: usize = 8;
    const EACH: usize = 25;
    let db = TestDb::migrated(backend);
    let made = crate::common::race(&db, THREADS, |t, conn| {
        let mut ids = Vec::new();
        for _ in 0..EACH {
            let id = if t < 2 {
                tenure::transaction(conn, |c| {
                    jobs::enqueue(c, &job(SequenceFailure::Hold)).map(|e| e.id)
                })
                .unwrap()
            } else {
                enqueue_id(conn, job(SequenceFailure::Hold))
            };
            ids.push(id);
        }
        ids
    });
    let total = THREADS * EACH;
    let mut conn = db.connect();
    assert_eq!(
        crate::common::count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'"
        ),
        1,
        "more than one job of the key runnable at once"
    );
    let edges = crate::common::count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_job_dependencies",
    );
    let heads = crate::common::count(
        &mut conn,
        "SELECT COUNT(DISTINCT depends_on) AS n FROM tenure_job_dependencies",
    );
    assert_eq!(edges as usize, total - 1, "not one chain");
    assert_eq!(heads as usize, total - 1, "two jobs wait for one");
    // Each thread's own jobs keep its order in the chain.
    let mut ran = Vec::new();
    loop {
        let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
        if claimed.is_empty() {
            break;
        }
        assert_eq!(claimed.len(), 1, "two of the key at once: {claimed:?}");
        ran.push(claimed[0].id);
        jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    }
    assert_eq!(ran.len(), total, "jobs lost: ran {} of {total}", ran.len());
    let position: std::collections::HashMap<i64, usize> =
        ran.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    for ids in made {
        for pair in ids.windows(2) {
            assert!(
                position[&pair[0]] < position[&pair[1]],
                "a thread's later enqueue ran first: {pair:?}"
            );
        }
    }
}

/// a waits; a caller's transaction enqueues b on the key and rolls back, while another
/// connection's enqueue of c waits for the key. c waits for a (not for b, which never
/// existed), and runs once a completes; a later d follows c.
fn a_rolled_back_enqueue_leaves_the_key_to_the_job_before_it(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue_id(&mut conn, job(SequenceFailure::Hold));
    let held = Arc::new(Barrier::new(2));
    let roller = {
        let mut c = db.connect();
        let held = held.clone();
        std::thread::spawn(move || {
            let outcome: Result<(), tenure::Error> = tenure::transaction(&mut c, |c| {
                jobs::enqueue(c, &job(SequenceFailure::Hold))?;
                held.wait();
                // The other enqueue is waiting for the key (or for the write lock).
                std::thread::sleep(Duration::from_millis(300));
                Err(tenure::Error::InvalidInput {
                    field: "test",
                    reason: "roll back".into(),
                })
            });
            assert!(outcome.is_err());
        })
    };
    held.wait();
    let c = enqueue_id(&mut conn, job(SequenceFailure::Hold));
    roller.join().unwrap();
    assert_eq!(job_state(&mut conn, c), JobState::Blocked);
    let run = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(run.iter().map(|j| j.id).collect::<Vec<_>>(), vec![a]);
    jobs::complete(&mut conn, &[run[0].claim()]).unwrap();
    let d = enqueue_id(&mut conn, job(SequenceFailure::Hold));
    let run = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(
        run.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![c],
        "c lost its place"
    );
    jobs::complete(&mut conn, &[run[0].claim()]).unwrap();
    assert_eq!(claim_ids(&mut conn), vec![d]);
}

/// Found by attack (deadlocks returned to the callers on MariaDB and PostgreSQL): two threads
/// bulk-enqueue jobs of four keys at once, 20 rounds, one in key order and one in reverse.
/// A batch now locks its keys sorted first: both batches commit every time, and each key's
/// jobs alternate correctly in one chain.
fn two_batches_taking_keys_in_opposite_orders_both_commit(backend: Backend) {
    const ROUNDS: usize = 20;
    let db = TestDb::migrated(backend);
    let failures = crate::common::race(&db, 2, |t, conn| {
        let mut failed = Vec::new();
        for round in 0..ROUNDS {
            let mut keys: Vec<usize> = (0..4).collect();
            if t == 1 {
                keys.reverse();
            }
            let batch: Vec<NewJob> = keys
                .iter()
                .map(|k| NewJob::new("q", "s", vec![]).sequence(format!("k{k}")))
                .collect();
            if let Err(e) = jobs::enqueue_many(conn, &batch) {
                failed.push(format!("thread {t} round {round}: {e}"));
            }
        }
        failed
    });
    let failures: Vec<String> = failures.into_iter().flatten().collect();
    assert!(failures.is_empty(), "{failures:#?}");
    let mut conn = db.connect();
    assert_eq!(
        crate::common::count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'"
        ),
        4
    );
}

/// Two producers enqueue 80 jobs each on one key (`Continue`) while three consumers claim
/// and finish them, a fifth of them dying: enqueues race the completion of the key's last
/// job (between the key's lock and the predecessor's). Every call succeeds, no job is left
/// blocked or waiting, no two run at once, and they run in id order (enqueue order).
fn enqueues_racing_completions_and_deaths_lose_nothing_and_keep_order(backend: Backend) {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const EACH: usize = 80;
    const TOTAL: usize = 2 * EACH;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let deadline = tenure::database_now(&mut conn).unwrap() + chrono::Duration::seconds(300);
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let ran = Arc::new(Mutex::new(Vec::<i64>::new()));
    let running = Arc::new(Mutex::new(None::<i64>));
    let finished = Arc::new(AtomicUsize::new(0));
    let producers: Vec<_> = (0..2)
        .map(|_| {
            let (mut c, errors) = (db.connect(), errors.clone());
            std::thread::spawn(move || {
                for _ in 0..EACH {
                    if let Err(e) = jobs::enqueue(&mut c, &job(SequenceFailure::Continue)) {
                        errors.lock().unwrap().push(format!("enqueue: {e}"));
                    }
                }
            })
        })
        .collect();
    let consumers: Vec<_> = (0..3)
        .map(|_| {
            let mut c = db.connect();
            let (errors, ran, running, finished) = (
                errors.clone(),
                ran.clone(),
                running.clone(),
                finished.clone(),
            );
            std::thread::spawn(move || {
                while finished.load(Ordering::SeqCst) < TOTAL
                    && tenure::database_now(&mut c).unwrap() < deadline
                {
                    let claimed = match jobs::claim(&mut c, "q", 1, TTL) {
                        Ok(claimed) => claimed,
                        Err(e) => {
                            errors.lock().unwrap().push(format!("claim: {e}"));
                            continue;
                        }
                    };
                    let Some(run) = claimed.first() else {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    };
                    {
                        let mut now = running.lock().unwrap();
                        if let Some(other) = *now {
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("{} claimed while {other} ran", run.id));
                        }
                        *now = Some(run.id);
                        ran.lock().unwrap().push(run.id);
                        // The run ends here, before its finish commits and releases the next.
                        *now = None;
                    }
                    let outcome = if run.id % 5 == 0 {
                        jobs::fail(&mut c, run.claim(), "dies", jobs::Retry::Never).map(|_| ())
                    } else {
                        jobs::complete(&mut c, &[run.claim()]).map(|_| ())
                    };
                    if let Err(e) = outcome {
                        errors
                            .lock()
                            .unwrap()
                            .push(format!("finish {}: {e}", run.id));
                    }
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in producers.into_iter().chain(consumers) {
        t.join().unwrap();
    }
    let errors = std::mem::take(&mut *errors.lock().unwrap());
    assert!(errors.is_empty(), "{errors:#?}");
    let left = crate::common::count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('blocked', 'waiting', 'running')",
    );
    assert_eq!(left, 0, "jobs left unfinished (lost)");
    let ran = std::mem::take(&mut *ran.lock().unwrap());
    assert_eq!(ran.len(), TOTAL);
    assert!(
        ran.windows(2).all(|w| w[0] < w[1]),
        "not run in enqueue order: {ran:?}"
    );
}

/// A workflow step with a sequence that comes after another step (so it gets dependencies,
/// which a sequence refuses) is an `InvalidInput`, and the workflow writes nothing: no job,
/// no workflow, no key.
fn a_workflow_step_with_a_sequence_and_dependencies_is_refused_and_writes_nothing(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut flow = jobs::Workflow::new("w");
    let first = flow.add(job(SequenceFailure::Hold));
    flow.add_after(&[first], job(SequenceFailure::Hold));
    let outcome = jobs::enqueue_workflow(&mut conn, &flow);
    assert!(
        matches!(outcome, Err(tenure::Error::InvalidInput { .. })),
        "{outcome:?}"
    );
    for table in ["tenure_jobs", "tenure_workflows", "tenure_sequences"] {
        assert_eq!(
            crate::common::count(&mut conn, &format!("SELECT COUNT(*) AS n FROM {table}")),
            0,
            "{table} written"
        );
    }
}

/// a waits. A caller's REPEATABLE READ transaction reads (its snapshot starts), another
/// connection enqueues b on the key, then the caller enqueues c. Either the caller's enqueue
/// fails (retryable, writing nothing) or c waits for b, not for a (which its snapshot shows
/// as the key's last): the jobs run a, b, c, one at a time.
fn an_enqueue_in_a_callers_repeatable_read_snapshot_chains_after_the_newest_job(backend: Backend) {
    use diesel::connection::Connection;
    use diesel::connection::SimpleConnection;
    let set = match backend {
        Backend::Postgres => {
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ"
        }
        Backend::Mysql => "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        // A deferred SQLite transaction's writer turn is not the point here.
        Backend::Sqlite => return,
    };
    let db = TestDb::migrated(backend);
    let (mut conn, mut caller) = (db.connect(), db.connect());
    caller.batch_execute(set).unwrap();
    let a = enqueue_id(&mut conn, job(SequenceFailure::Hold));
    let outcome = caller.transaction::<_, tenure::Error, _>(|c| {
        assert_eq!(jobs::get(c, a)?.unwrap().state, JobState::Waiting);
        let b = enqueue_id(&mut conn, job(SequenceFailure::Hold));
        let c_id = jobs::enqueue(c, &job(SequenceFailure::Hold))?.id;
        Ok((b, c_id))
    });
    let b = match outcome {
        Ok((b, c)) => {
            for expected in [a, b, c] {
                let run = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
                assert_eq!(
                    run.iter().map(|j| j.id).collect::<Vec<_>>(),
                    vec![expected],
                    "a={a} b={b} c={c}"
                );
                jobs::complete(&mut conn, &[run[0].claim()]).unwrap();
            }
            return;
        }
        Err(e) => {
            assert!(e.is_retryable(), "{e}");
            crate::common::count(&mut conn, "SELECT MAX(id) AS n FROM tenure_jobs")
        }
    };
    assert_eq!(
        crate::common::count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        2
    );
    assert_eq!(job_state(&mut conn, b), JobState::Blocked);
}

/// A batch of jobs on 50 keys, then one depending on a job that does not exist (refused only
/// when the batch reaches it, after the keys were locked and advanced): `InvalidInput`, and
/// nothing written, no key left pointing at a job that never existed; the keys work after.
fn a_batch_failing_after_its_sequenced_jobs_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k0"));
    let mut batch: Vec<NewJob> = (0..50)
        .map(|i| NewJob::new("q", "s", vec![]).sequence(format!("k{i}")))
        .collect();
    batch.push(NewJob::new("q", "s", vec![]).depends_on([a + 1_000_000]));
    let outcome = jobs::enqueue_many(&mut conn, &batch);
    assert!(
        matches!(outcome, Err(tenure::Error::InvalidInput { .. })),
        "{outcome:?}"
    );
    assert_eq!(
        crate::common::count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        1
    );
    assert_eq!(
        crate::common::count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_sequences WHERE last_job_id <> 0"
        ),
        1,
        "a key points at a job of the rolled-back batch"
    );
    let after = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k0"));
    assert_eq!(job_state(&mut conn, after), JobState::Blocked);
    let other = enqueue_id(&mut conn, NewJob::new("q", "s", vec![]).sequence("k1"));
    assert_eq!(job_state(&mut conn, other), JobState::Waiting);
}

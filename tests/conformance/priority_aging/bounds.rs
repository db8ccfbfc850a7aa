//! What keeps aging's bound: a limited call ages the jobs due first, a caller aging every
//! period with a limit smaller than the backlog still reaches the low job, aging is refused
//! inside a caller's transaction (where the ring, rotated since, read as empty), and aging
//! racing claims (of any kind and by kind), retries, snoozes, give-backs, deaths, revivals,
//! cancels, replacing duplicates, limited jobs and rotations leaves the ring exact.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, AGED_PRIORITY, JobState, NewJob, OnDuplicate, Outcome, Retry};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, conformance, enqueue_id};
use crate::ready_ring::{assert_ring_exact, rotate_times, spawn_rotator};

conformance!(
    a_limited_aging_call_ages_the_job_due_first,
    aging_every_period_with_a_limit_reaches_a_low_job_behind_an_urgent_backlog,
    aging_inside_a_callers_transaction_is_refused_and_changes_nothing,
    aging_racing_claims_retries_cancels_and_rotations_keeps_the_ring_exact,
);

const TTL: Duration = Duration::from_secs(600);
const URGENT: i32 = -10;
const LOW: i32 = 100;

/// Aged jobs are claimed "in the order they came due" and a job due for longer than the
/// bound is claimed "before any job that came due after it": with a limit of 1 the one call
/// must age the job due first. A low job due two hours ago, three urgent jobs due one hour
/// ago: the call ages one of the urgent ones (the candidate read walks the claim index by
/// priority, with no order by due time), which is then claimed ahead of the low job that
/// came due an hour before it.
fn a_limited_aging_call_ages_the_job_due_first(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let now = tenure::database_now(&mut conn).unwrap();
    let low = enqueue_id(
        &mut conn,
        NewJob::new("q", "low", vec![])
            .priority(LOW)
            .at(now - chrono::TimeDelta::hours(2)),
    );
    for _ in 0..3 {
        enqueue_id(
            &mut conn,
            NewJob::new("q", "urgent", vec![])
                .priority(URGENT)
                .at(now - chrono::TimeDelta::hours(1)),
        );
    }
    assert_eq!(
        jobs::age_priorities(&mut conn, "q", Duration::from_secs(1), 1).unwrap(),
        1
    );
    let first = jobs::claim(&mut conn, "q", 1, TTL).unwrap();
    assert_eq!(
        (first[0].id, first[0].priority),
        (low, AGED_PRIORITY),
        "{backend}: the one job aged and claimed first is not the one due first (the low job \
         {low}, due an hour before the others); claimed {:?}",
        first[0]
    );
}

/// A caller ages its queue every period with a limit of 5 while a backlog of 20 urgent jobs,
/// each due an hour ago, is claimed five at a time and refilled (no clock involved: every
/// job is due for far longer than the bound of 1 s at every call). The bound promised ("a
/// waiting job is claimed ahead of by more urgent jobs for at most after + period past its
/// due time") says the low job, due two hours ago, is claimed within a round or two; it is
/// never claimed in 100 rounds: each call ages the five most urgent candidates, never the
/// low one behind them.
fn aging_every_period_with_a_limit_reaches_a_low_job_behind_an_urgent_backlog(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let now = tenure::database_now(&mut conn).unwrap();
    let low = enqueue_id(
        &mut conn,
        NewJob::new("q", "low", vec![])
            .priority(LOW)
            .at(now - chrono::TimeDelta::hours(2)),
    );
    let urgent = |conn: &mut AnyConnection| {
        enqueue_id(
            conn,
            NewJob::new("q", "urgent", vec![])
                .priority(URGENT)
                .at(now - chrono::TimeDelta::hours(1)),
        )
    };
    for _ in 0..20 {
        urgent(&mut conn);
    }
    let mut claimed_low_at = None;
    let mut aged_total = 0;
    for round in 0..100 {
        aged_total += jobs::age_priorities(&mut conn, "q", Duration::from_secs(1), 5).unwrap();
        let batch = jobs::claim(&mut conn, "q", 5, TTL).unwrap();
        assert_eq!(batch.len(), 5);
        let claims: Vec<_> = batch.iter().map(|j| j.claim()).collect();
        jobs::complete(&mut conn, &claims).unwrap();
        if batch.iter().any(|j| j.id == low) {
            claimed_low_at = Some(round);
            break;
        }
        for _ in 0..5 {
            urgent(&mut conn);
        }
    }
    let job = jobs::get(&mut conn, low).unwrap().unwrap();
    assert!(
        claimed_low_at.is_some_and(|round| round <= 2),
        "{backend}: the low job, due two hours ago, was not claimed within two rounds of \
         aging every round (claimed in round {claimed_low_at:?}; {aged_total} urgent jobs \
         aged meanwhile; now {:?} at priority {})",
        job.state,
        job.priority
    );
}

/// Found by attack: aging inside a caller's REPEATABLE READ transaction, after rotations
/// moved the ready ring's entries, read the ring under the caller's snapshot and returned 0
/// ("nothing to do") on PostgreSQL while a job was due an hour ago, and never returned on
/// MariaDB (a prepared read under a view older than a partition's truncate: the client waits
/// for a reply the server never sends). Aging now refuses to run inside a transaction, on
/// every backend: `Error::InTransaction`, and the job keeps its priority. (Run on its own
/// thread with a guard, so that a hang fails the test instead of the run.)
fn aging_inside_a_callers_transaction_is_refused_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut caller = db.connect();
    let now = tenure::database_now(&mut conn).unwrap();
    let old = enqueue_id(
        &mut conn,
        NewJob::new("q", "a", vec![])
            .priority(LOW)
            .at(now - chrono::TimeDelta::hours(1)),
    );
    let (sent, outcome) = std::sync::mpsc::channel();
    let mut rotator = db.connect();
    std::thread::spawn(move || {
        match backend {
            Backend::Postgres => caller.batch_execute(
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            ),
            Backend::Mysql => {
                caller.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            }
            Backend::Sqlite => Ok(()),
        }
        .unwrap();
        let outcome = caller.transaction::<_, Error, _>(|c| {
            assert_eq!(jobs::get(c, old)?.unwrap().state, JobState::Waiting);
            let rotated = rotate_times(&mut rotator, 3);
            if backend != Backend::Sqlite {
                assert_eq!(rotated, 3, "rotations under the caller's snapshot");
            }
            jobs::age_priorities(c, "q", Duration::from_secs(1), 10)
        });
        let _ = sent.send(outcome);
    });
    let Ok(outcome) = outcome.recv_timeout(Duration::from_secs(30)) else {
        // The hung session holds the caller's transaction: dropping the database would wait
        // for it too.
        std::mem::forget(db);
        panic!("{backend}: aging in a REPEATABLE READ transaction did not return in 30 s");
    };
    assert!(
        matches!(outcome, Err(Error::InTransaction { .. })),
        "{backend}: aging inside a transaction gave {outcome:?}"
    );
    assert_eq!(jobs::get(&mut conn, old).unwrap().unwrap().priority, LOW);
    assert_ring_exact(&mut conn, backend, "after a refused aging");
    // Outside the transaction it ages the job.
    assert_eq!(
        jobs::age_priorities(&mut conn, "q", Duration::from_secs(1), 10).unwrap(),
        1
    );
}

/// A small deterministic generator (xorshift), one per thread.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A job of one of several shapes: plain, keyed with a replacing duplicate, under a limit
/// of 2, of kind "a" or "b", due now or a second ago, of any of three priorities.
fn some_job(rng: &mut Rng) -> NewJob {
    let kind = if rng.below(2) == 0 { "a" } else { "b" };
    let priority = [URGENT, 0, LOW][rng.below(3) as usize];
    let job = NewJob::new("q", kind, vec![]).priority(priority);
    match rng.below(4) {
        0 => job
            .dedup_key(format!("k{}", rng.below(4)))
            .on_duplicate(OnDuplicate::Replace),
        1 => job.limit("lim", 2),
        _ => job,
    }
}

/// Aging (a bound of 1 ms, 20 jobs a call, as fast as it can) races three claimers (of any
/// kind and of kind "a") that complete, retry at once, snooze, give back or kill what they
/// claim and enqueue a job of some shape in its place, a thread that enqueues replacing
/// duplicates and limited jobs, cancels and revives dead jobs, and (on the servers) a
/// rotator. No call may fail (transient conflicts are retried inside), no claimed job's
/// priority may change while it runs, every finish must find its claim, and the ring must
/// list exactly the waiting jobs with their priorities after.
fn aging_racing_claims_retries_cancels_and_rotations_keeps_the_ring_exact(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut seed = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..60 {
        enqueue_id(&mut conn, some_job(&mut seed));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let aged = Arc::new(AtomicUsize::new(0));
    let claimed = Arc::new(AtomicUsize::new(0));
    let ager = {
        let (mut c, stop, errors, aged) =
            (db.connect(), stop.clone(), errors.clone(), aged.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match jobs::age_priorities(&mut c, "q", Duration::from_millis(1), 20) {
                    Ok(n) => {
                        aged.fetch_add(n, Ordering::SeqCst);
                    }
                    Err(e) => errors.lock().unwrap().push(format!("aging: {e}")),
                }
            }
        })
    };
    let claimers: Vec<_> = (0..3u64)
        .map(|n| {
            let (mut c, errors, claimed) = (db.connect(), errors.clone(), claimed.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x2545_f491_4f6c_dd1d + n * 7919);
                for _ in 0..150 {
                    let batch = if n == 2 {
                        jobs::claim_kinds(&mut c, "q", &["a"], 2, TTL)
                    } else {
                        jobs::claim(&mut c, "q", 2, TTL)
                    };
                    let batch = match batch {
                        Ok(batch) => batch,
                        Err(e) => {
                            errors.lock().unwrap().push(format!("claim: {e}"));
                            continue;
                        }
                    };
                    claimed.fetch_add(batch.len(), Ordering::SeqCst);
                    for job in batch {
                        // Aging does not touch a running job.
                        std::thread::sleep(Duration::from_millis(rng.below(3)));
                        let now = jobs::get(&mut c, job.id).unwrap().unwrap();
                        if now.state == JobState::Running && now.priority != job.priority {
                            errors.lock().unwrap().push(format!(
                                "job {} changed from priority {} to {} while claimed",
                                job.id, job.priority, now.priority
                            ));
                        }
                        let outcome = match rng.below(5) {
                            0 => jobs::fail(
                                &mut c,
                                job.claim(),
                                "again",
                                Retry::After(Duration::ZERO),
                            ),
                            1 => jobs::snooze(&mut c, job.claim(), Duration::from_millis(1)),
                            2 => jobs::give_back(&mut c, &[job.claim()])
                                .map(|o| o.into_iter().next().unwrap_or(Outcome::Lost)),
                            3 => jobs::fail(&mut c, job.claim(), "dead", Retry::Never),
                            _ => jobs::complete(&mut c, &[job.claim()])
                                .map(|o| o.into_iter().next().unwrap_or(Outcome::Lost)),
                        };
                        match outcome {
                            Ok(Outcome::Done | Outcome::Cancelled) => {}
                            other => errors
                                .lock()
                                .unwrap()
                                .push(format!("finishing job {}: {other:?}", job.id)),
                        }
                        if let Err(e) = jobs::enqueue(&mut c, &some_job(&mut rng)) {
                            errors.lock().unwrap().push(format!("enqueue: {e}"));
                        }
                    }
                }
            })
        })
        .collect();
    let churner = {
        let (mut c, stop, errors) = (db.connect(), stop.clone(), errors.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(0x1234_5678_9abc_def1);
            let mut last = 0;
            while !stop.load(Ordering::SeqCst) {
                match jobs::enqueue(&mut c, &some_job(&mut rng)) {
                    Ok(job) => last = last.max(job.id),
                    Err(e) => errors.lock().unwrap().push(format!("enqueue: {e}")),
                }
                let id = 1 + rng.below(last.max(1) as u64) as i64;
                let changed = if rng.below(2) == 0 {
                    jobs::cancel(&mut c, id)
                } else {
                    jobs::retry_dead(&mut c, id)
                };
                match changed {
                    Ok(_) | Err(Error::InvalidInput { .. }) => {}
                    Err(e) => errors
                        .lock()
                        .unwrap()
                        .push(format!("cancel or revive {id}: {e}")),
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let (rotator, rotations) = spawn_rotator(db.connect(), stop.clone(), Duration::from_millis(3));
    for claimer in claimers {
        claimer.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    ager.join().unwrap();
    churner.join().unwrap();
    rotator.join().unwrap();
    let errors = std::mem::take(&mut *errors.lock().unwrap());
    assert!(
        errors.is_empty(),
        "{backend}: {} failures ({} claimed, {} aged, {} rotations): {errors:#?}",
        errors.len(),
        claimed.load(Ordering::SeqCst),
        aged.load(Ordering::SeqCst),
        rotations.load(Ordering::SeqCst)
    );
    assert!(
        aged.load(Ordering::SeqCst) > 0,
        "{backend}: nothing aged: the race showed nothing"
    );
    assert_ring_exact(&mut conn, backend, "after aging raced everything");
}

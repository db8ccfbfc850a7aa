//! Queue-wide limits under concurrency: a limit set while claims are in flight, claimers,
//! finishers, cancellers and pruners of limited jobs, and claims of any and of some kinds in a
//! limited queue.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use diesel::connection::SimpleConnection;
use tenure::Backend;
use tenure::jobs::{self, Finished, Limit, NewJob, Retention, Retry};

use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    a_queue_limit_set_during_an_in_flight_claim_is_never_exceeded,
    claimers_finishers_cancellers_and_pruners_of_limited_jobs_keep_every_cap,
    claims_of_any_kind_and_of_some_kinds_in_a_limited_queue_do_not_deadlock,
);

const TTL: Duration = Duration::from_secs(600);

/// Fixed: a claim reads the queue's limit again after the keys' locks and, if one was
/// created meanwhile, takes nothing (the next claim takes the queue's lock first).
///
/// Queue `q` has no limit. Claim A (kind `a`, its job carries a concurrency cap on key `k`)
/// picks its job, seeing no queue limit, and waits for `k`'s lock (held here by another
/// transaction, as a claim of `k` elsewhere would). Meanwhile `limit_queue(q, 1)` commits,
/// with nothing of `q` running, and claim B (kind `b`, no key) claims one job: it is the
/// first claim under the limit and finds the queue empty. Then `k`'s lock is released and
/// A goes on: it decides on the queue limit its pick read (none) and takes no queue lock,
/// so it claims too: two running jobs in a queue limited to one, though the limit was
/// set while none ran. No serial order of A, the limit and B gives that (B after the limit
/// would count A's job if A came before the limit, and A after the limit would be held to
/// it). SQLite's IMMEDIATE claim transaction serializes everything: nothing to interleave.
fn a_queue_limit_set_during_an_in_flight_claim_is_never_exceeded(backend: Backend) {
    if backend == Backend::Sqlite {
        return;
    }
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).limit("k", 10)).unwrap();
    jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![])).unwrap();
    // Hold k's lock as a claim would (the key's row, locked until rollback).
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; INSERT INTO tenure_limit_keys (limit_key) VALUES ('k')")
        .unwrap();
    let mut a_conn = db.connect();
    let a = std::thread::spawn(move || {
        jobs::claim_kinds(&mut a_conn, "q", &["a"], 1, TTL)
            .unwrap()
            .len()
    });
    // A has picked and waits for k's lock.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(!a.is_finished(), "claim A did not wait for k's lock");
    jobs::limit_queue(&mut conn, "q", Some(1)).unwrap();
    let b = jobs::claim_kinds(&mut conn, "q", &["b"], 1, TTL)
        .unwrap()
        .len();
    holder.batch_execute("ROLLBACK").unwrap();
    let a = a.join().unwrap();
    let running = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'q' AND state = 'running'",
    );
    assert!(
        running <= 1,
        "{running} jobs of q run under a queue limit of 1 (claim A took {a}, claim B took {b})"
    );
}

fn limited_job(i: usize) -> NewJob {
    let kind = if i % 2 == 0 { "a" } else { "b" };
    let job = NewJob::new("q", kind, vec![]);
    if i % 5 == 4 {
        return job;
    }
    job.with_limit(Limit::concurrency(format!("c{}", i % 6), 2))
        .with_limit(Limit::rate(
            format!("r{}", i % 4),
            3,
            Duration::from_millis(50),
        ))
}

/// For 3 s: 6 claimers (any kind, or kind `a` or `b`) complete, give back or kill what
/// they claim; a canceller cancels jobs, retries dead ones and enqueues more; a pruner
/// deletes finished jobs. Jobs carry a cap of 2 on one of 6 keys and a rate of 3 per 50 ms
/// on one of 4 keys; the queue is limited to 4. A checker counts running jobs per key and
/// in the queue (one statement each). No call may fail but with a retryable error, none
/// may hang, no cap may be exceeded, and no 50 ms window may hold more than 3 starts of a key.
fn claimers_finishers_cancellers_and_pruners_of_limited_jobs_keep_every_cap(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::limit_queue(&mut conn, "q", Some(4)).unwrap();
    let batch: Vec<NewJob> = (0..400).map(limited_job).collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let retryable = Arc::new(AtomicI64::new(0));
    let claims = Arc::new(AtomicI64::new(0));
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let check = |r: tenure::Result<()>,
                 what: &str,
                 retryable: &AtomicI64,
                 failures: &Mutex<Vec<String>>| {
        if let Err(e) = r {
            if e.is_retryable() {
                if retryable.fetch_add(1, Ordering::Relaxed) % 40 == 0 {
                    eprintln!("retryable, {what}: {e}");
                }
            } else {
                failures.lock().unwrap().push(format!("{what}: {e}"));
            }
        }
    };
    let mut handles = Vec::new();
    for t in 0..6usize {
        let mut c = db.connect();
        let (stop, retryable, failures, claims) = (
            stop.clone(),
            retryable.clone(),
            failures.clone(),
            claims.clone(),
        );
        handles.push(std::thread::spawn(move || {
            let mut round = 0usize;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let r = (|| -> tenure::Result<()> {
                    let claimed = match t % 3 {
                        0 => jobs::claim(&mut c, "q", 2, TTL)?,
                        1 => jobs::claim_kinds(&mut c, "q", &["a"], 2, TTL)?,
                        _ => jobs::claim_kinds(&mut c, "q", &["a", "b"], 2, TTL)?,
                    };
                    claims.fetch_add(claimed.len() as i64, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(2));
                    for job in claimed {
                        match (round + job.id as usize) % 4 {
                            0 => drop(jobs::give_back(&mut c, &[job.claim()])?),
                            1 => drop(jobs::fail(&mut c, job.claim(), "x", Retry::Never)?),
                            _ => drop(jobs::complete(&mut c, &[job.claim()])?),
                        }
                    }
                    Ok(())
                })();
                check(r, "claimer", &retryable, &failures);
            }
        }));
    }
    {
        let mut c = db.connect();
        let (stop, retryable, failures) = (stop.clone(), retryable.clone(), failures.clone());
        handles.push(std::thread::spawn(move || {
            let mut i = 400usize;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = (|| -> tenure::Result<()> {
                    let id = jobs::enqueue(&mut c, &limited_job(i))?.id;
                    jobs::cancel(&mut c, id - 7)?;
                    jobs::retry_dead(&mut c, id - 13)?;
                    Ok(())
                })();
                check(r, "canceller", &retryable, &failures);
            }
        }));
    }
    {
        let mut c = db.connect();
        let (stop, retryable, failures) = (stop.clone(), retryable.clone(), failures.clone());
        handles.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for f in [Finished::Completed, Finished::Dead, Finished::Cancelled] {
                    let r = jobs::prune(&mut c, "q", f, Retention::DeleteAll, 20).map(drop);
                    check(r, "pruner", &retryable, &failures);
                }
            }
        }));
    }
    let mut worst = (0i64, 0i64);
    let end = Clock::now() + Duration::from_secs(3);
    while Clock::now() < end {
        let queue = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'q' AND state = 'running'",
        );
        let key = count(
            &mut conn,
            "SELECT COALESCE(MAX(n), 0) AS n FROM (SELECT COUNT(*) AS n FROM tenure_jobs r \
             JOIN tenure_job_limits l ON l.job_id = r.id WHERE r.state = 'running' \
             AND l.max_running IS NOT NULL GROUP BY l.limit_key) t",
        );
        worst = (worst.0.max(queue), worst.1.max(key));
    }
    stop.store(true, Ordering::Relaxed);
    let deadline = Clock::now() + Duration::from_secs(60);
    for h in handles {
        poll_until(
            deadline.saturating_duration_since(Clock::now()),
            Duration::from_millis(20),
            || h.is_finished().then_some(()),
        )
        .expect("a thread hung");
        h.join().unwrap();
    }
    // Every window of 50 ms holds at most 3 starts of a rate key.
    let mut crowded = Vec::new();
    for k in 0..4 {
        let starts: Vec<chrono::DateTime<chrono::Utc>> = crate::common::concrete!(&mut conn, c => {
            use diesel::prelude::*;
            tenure::schema::tenure_limit_starts::table
                .filter(tenure::schema::tenure_limit_starts::limit_key.eq(format!("r{k}")))
                .order(tenure::schema::tenure_limit_starts::started_at)
                .select(tenure::schema::tenure_limit_starts::started_at)
                .load(c)
                .unwrap()
        });
        for w in starts.windows(4) {
            if w[3] - w[0] < chrono::TimeDelta::milliseconds(50) {
                crowded.push((k, w[0], w[3]));
            }
        }
    }
    let failures = failures.lock().unwrap().clone();
    eprintln!(
        "{backend:?}: {} claims, {} retryable errors, worst running: queue {}, key {}",
        claims.load(Ordering::Relaxed),
        retryable.load(Ordering::Relaxed),
        worst.0,
        worst.1
    );
    assert!(
        failures.is_empty(),
        "non-retryable errors: {:?}",
        &failures[..failures.len().min(5)]
    );
    assert!(worst.0 <= 4 && worst.1 <= 2, "caps exceeded: {worst:?}");
    assert!(
        crowded.is_empty(),
        "windows of 50 ms with 4 starts: {:?}",
        &crowded[..crowded.len().min(5)]
    );
}

/// MariaDB: a claim of some kinds (`claim_kinds`, as every worker claims) picks through the
/// kind index, locking each entry and then its row, skipping rows others hold; an entry whose
/// row was skipped stays locked. A claim of any kind (`claim`) picks through the claim index,
/// then takes the queue's lock (or a key's), then marks its rows running, which rewrites
/// their kind-index entries: it waits for the kinds claim, which waits for the queue's lock
/// it holds. A deadlock, though admission says claimers never wait on each other in a cycle
/// (found by the race above: about 30% of claims of 6 mixed claimers failed). Retryable, but
/// a worker backs off 100 ms or more and logs a warning for each. For 3 s, 2 claimers of any
/// kind and 2 of kinds `a` and `b` claim and complete jobs of a queue limited to 4: no claim
/// may fail. Fixed: a limited queue's lock is taken before the pick locks any job row.
fn claims_of_any_kind_and_of_some_kinds_in_a_limited_queue_do_not_deadlock(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::limit_queue(&mut conn, "q", Some(4)).unwrap();
    let batch: Vec<NewJob> = (0..3000)
        .map(|i| NewJob::new("q", if i % 2 == 0 { "a" } else { "b" }, vec![]))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let end = Clock::now() + Duration::from_secs(3);
    let results = crate::common::race(&db, 4, move |t, c| {
        let (mut claimed, mut errors) = (0, Vec::new());
        while Clock::now() < end {
            let r = if t % 2 == 0 {
                jobs::claim(c, "q", 2, TTL)
            } else {
                jobs::claim_kinds(c, "q", &["a", "b"], 2, TTL)
            };
            match r {
                Ok(jobs) => {
                    claimed += jobs.len();
                    let claims: Vec<_> = jobs.iter().map(|j| j.claim()).collect();
                    if !claims.is_empty() {
                        jobs::complete(c, &claims).unwrap();
                    }
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        (claimed, errors)
    });
    let claimed: usize = results.iter().map(|r| r.0).sum();
    let errors: Vec<&String> = results.iter().flat_map(|r| &r.1).collect();
    assert!(
        errors.is_empty(),
        "{} of the claims failed ({claimed} jobs claimed), e.g. {}",
        errors.len(),
        errors[0]
    );
}

//! Priority without starvation: a job due for longer than the aging bound moves to the front
//! of its queue ([`jobs::age_priorities`]), so a steady stream of more urgent jobs delays it
//! by at most the bound; without aging the same stream starves it (the negative control).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod bounds;

use tenure::Backend;
use tenure::events::Event;
use tenure::jobs::{self, AGED_PRIORITY, JobState, NewJob, Retry};
use tenure::worker::{JobContext, Worker};

use crate::common::{TestDb, conformance, count, enqueue_id, wait_for_db_clock, wait_until};

conformance!(
    a_steady_stream_of_urgent_jobs_starves_a_low_priority_job_without_aging,
    an_aged_job_is_claimed_before_any_urgent_job_claimed_after_its_aging,
    only_waiting_jobs_due_longer_than_the_bound_are_aged,
    an_aged_job_keeps_the_front_through_a_retry,
    bad_aging_input_is_refused_and_changes_nothing,
    a_worker_ages_its_queues_and_runs_the_starved_job,
);

const TTL: Duration = Duration::from_secs(600);
const URGENT: i32 = -10;
const LOW: i32 = 100;
const CLAIMERS: usize = 4;
/// Urgent jobs kept waiting: every claim of one is followed by the enqueue of another.
const BACKLOG: usize = 40;

/// Four claimers on their own connections, each claiming one job at a time, completing it and
/// enqueueing a new urgent job in its place, with the low-priority job due from the start.
/// `age` (if any) runs beside them on a fifth connection. Returns, per claim in the order
/// claims began, `(began, priority claimed at, was the low job)`, and the sequence number
/// at which the low job was seen aged (`i64::MAX` if never), stopping when the low job is
/// claimed or after `max_claims`.
fn stream(db: &TestDb, max_claims: usize, age: Option<Duration>) -> (Vec<(i64, i32, bool)>, i64) {
    let mut conn = db.connect();
    let low = enqueue_id(&mut conn, NewJob::new("q", "low", vec![]).priority(LOW));
    for _ in 0..BACKLOG {
        enqueue_id(
            &mut conn,
            NewJob::new("q", "urgent", vec![]).priority(URGENT),
        );
    }
    let seq = Arc::new(AtomicI64::new(0));
    let aged_at = Arc::new(AtomicI64::new(i64::MAX));
    let done = Arc::new(AtomicBool::new(false));
    let claims = Arc::new(AtomicUsize::new(0));
    let log = Arc::new(Mutex::new(Vec::new()));
    let ager = age.map(|after| {
        let (mut c, seq, aged_at, done) =
            (db.connect(), seq.clone(), aged_at.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                jobs::age_priorities(&mut c, "q", after, 1000).unwrap();
                // Taken after the aging committed: every claim begun later sees it.
                let after_call = seq.fetch_add(1, Ordering::SeqCst);
                let job = jobs::get(&mut c, low).unwrap().unwrap();
                if job.priority == AGED_PRIORITY && aged_at.load(Ordering::SeqCst) == i64::MAX {
                    aged_at.store(after_call, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    });
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let (mut c, seq, done, claims, log) = (
                db.connect(),
                seq.clone(),
                done.clone(),
                claims.clone(),
                log.clone(),
            );
            std::thread::spawn(move || {
                while !done.load(Ordering::SeqCst)
                    && claims.fetch_add(1, Ordering::SeqCst) < max_claims
                {
                    // A claim may find every waiting job locked for a moment (the ager's
                    // batch holds the urgent jobs waiting past the bound too, which a slow
                    // machine makes all of them): it claims again, as a claim begun anew.
                    let tried_until = std::time::Instant::now() + Duration::from_secs(30);
                    let (began, claimed) = loop {
                        let began = seq.fetch_add(1, Ordering::SeqCst);
                        let claimed = jobs::claim(&mut c, "q", 1, TTL).unwrap();
                        if !claimed.is_empty() {
                            break (began, claimed);
                        }
                        assert!(
                            std::time::Instant::now() < tried_until,
                            "the urgent backlog ran dry for 30 s"
                        );
                        std::thread::sleep(Duration::from_millis(1));
                    };
                    assert_eq!(claimed.len(), 1);
                    let job = &claimed[0];
                    jobs::complete(&mut c, &[job.claim()]).unwrap();
                    let is_low = job.id == low;
                    log.lock().unwrap().push((began, job.priority, is_low));
                    if is_low {
                        done.store(true, Ordering::SeqCst);
                    } else {
                        jobs::enqueue(&mut c, &NewJob::new("q", "urgent", vec![]).priority(URGENT))
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    for claimer in claimers {
        claimer.join().unwrap();
    }
    done.store(true, Ordering::SeqCst);
    if let Some(ager) = ager {
        ager.join().unwrap();
    }
    let mut log = std::mem::take(&mut *log.lock().unwrap());
    log.sort_unstable();
    (log, aged_at.load(Ordering::SeqCst))
}

/// The negative control: 600 claims of a queue that always holds urgent jobs, and the job of
/// lower priority, due first, is never claimed.
fn a_steady_stream_of_urgent_jobs_starves_a_low_priority_job_without_aging(backend: Backend) {
    let db = TestDb::migrated(backend);
    let (log, _) = stream(&db, 600, None);
    assert_eq!(log.len(), 600);
    assert!(
        log.iter().all(|(_, _, low)| !low),
        "the low-priority job was claimed without aging: the control shows nothing"
    );
}

/// With aging (bound 100 ms) beside four claimers of a steady urgent stream, the low job is
/// claimed at the aged priority, and of the claims begun after its aging was seen, those that
/// took an urgent job before it number fewer than the claimers (only claims already in flight
/// while another took it can miss it: each claimer misses it at most once).
fn an_aged_job_is_claimed_before_any_urgent_job_claimed_after_its_aging(backend: Backend) {
    let db = TestDb::migrated(backend);
    let (log, aged_at) = stream(&db, 3_000, Some(Duration::from_millis(100)));
    let low = log
        .iter()
        .find(|(_, _, low)| *low)
        .expect("the low job was never claimed");
    assert_eq!(
        low.1, AGED_PRIORITY,
        "the low job was claimed without being aged"
    );
    // The low job's claim may begin before the ager counts its call (it is claimable from the
    // aging's commit on): then no claim falls between the two.
    assert!(
        aged_at < i64::MAX,
        "the aging of the low job was never seen"
    );
    let passed_over = log
        .iter()
        .filter(|(began, _, is_low)| *began > aged_at && *began < low.0 && !is_low)
        .count();
    assert!(
        passed_over < CLAIMERS,
        "{passed_over} claims begun after the aging took other jobs first (claims {log:?})"
    );
}

/// Aging reads only waiting jobs of its queue due for longer than the bound: one due just
/// now, one due in an hour, a running one, one of another queue and one already aged are
/// left as they are, and a second call finds nothing.
fn only_waiting_jobs_due_longer_than_the_bound_are_aged(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let old = enqueue_id(&mut conn, NewJob::new("q", "a", vec![]).priority(5));
    let running = enqueue_id(&mut conn, NewJob::new("q", "b", vec![]).priority(5));
    let claimed = jobs::claim_kinds(&mut conn, "q", &["b"], 1, TTL).unwrap();
    assert_eq!(claimed[0].id, running);
    let other = enqueue_id(&mut conn, NewJob::new("other", "a", vec![]).priority(5));
    let now = tenure::database_now(&mut conn).unwrap();
    wait_for_db_clock(&mut conn, now + chrono::TimeDelta::seconds(2));
    let later = enqueue_id(
        &mut conn,
        NewJob::new("q", "a", vec![])
            .priority(5)
            .delay(Duration::from_secs(3600)),
    );
    let fresh = enqueue_id(&mut conn, NewJob::new("q", "a", vec![]).priority(5));
    assert_eq!(
        jobs::age_priorities(&mut conn, "q", Duration::from_secs(1), 100).unwrap(),
        1
    );
    assert_eq!(
        jobs::age_priorities(&mut conn, "q", Duration::from_secs(1), 100).unwrap(),
        0
    );
    let priority = |conn: &mut _, id| jobs::get(conn, id).unwrap().unwrap().priority;
    assert_eq!(priority(&mut conn, old), AGED_PRIORITY);
    for id in [running, other, later, fresh] {
        assert_eq!(priority(&mut conn, id), 5, "job {id} was aged");
    }
    // The claim order follows: the aged job first though it was enqueued with the others.
    let first = jobs::claim(&mut conn, "q", 1, TTL).unwrap();
    assert_eq!(first[0].id, old);
}

/// A retried aged job keeps its place at the front (the retry does not give it back its
/// old priority), and a limit of 1 ages one job a call, the earliest due.
fn an_aged_job_keeps_the_front_through_a_retry(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let first = enqueue_id(&mut conn, NewJob::new("q", "a", vec![]).priority(3));
    let second = enqueue_id(&mut conn, NewJob::new("q", "a", vec![]).priority(3));
    let now = tenure::database_now(&mut conn).unwrap();
    wait_for_db_clock(&mut conn, now + chrono::TimeDelta::milliseconds(200));
    assert_eq!(
        jobs::age_priorities(&mut conn, "q", Duration::from_millis(100), 1).unwrap(),
        1
    );
    assert_eq!(
        jobs::age_priorities(&mut conn, "q", Duration::from_millis(100), 1).unwrap(),
        1
    );
    let claimed = jobs::claim(&mut conn, "q", 1, TTL).unwrap();
    assert_eq!(claimed[0].id, first);
    jobs::fail(
        &mut conn,
        claimed[0].claim(),
        "again",
        Retry::After(Duration::ZERO),
    )
    .unwrap();
    let job = jobs::get(&mut conn, first).unwrap().unwrap();
    assert_eq!(
        (job.state, job.priority),
        (JobState::Waiting, AGED_PRIORITY)
    );
    enqueue_id(&mut conn, NewJob::new("q", "a", vec![]).priority(URGENT));
    let next: Vec<i64> = jobs::claim(&mut conn, "q", 2, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(
        next,
        vec![second, first],
        "aged jobs first, in the order they came due"
    );
}

/// A bound of zero or past 366 days, a limit of 0 or past the batch size and a bad queue
/// name are typed errors that change nothing; so is a worker built with a bad bound.
fn bad_aging_input_is_refused_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = enqueue_id(&mut conn, NewJob::new("q", "a", vec![]).priority(5));
    let now = tenure::database_now(&mut conn).unwrap();
    wait_for_db_clock(&mut conn, now + chrono::TimeDelta::milliseconds(50));
    let refused = [
        jobs::age_priorities(&mut conn, "q", Duration::ZERO, 10),
        jobs::age_priorities(&mut conn, "q", Duration::from_secs(367 * 86_400), 10),
        jobs::age_priorities(&mut conn, "q", Duration::from_millis(1), 0),
        jobs::age_priorities(
            &mut conn,
            "q",
            Duration::from_millis(1),
            jobs::MAX_BATCH + 1,
        ),
        jobs::age_priorities(&mut conn, "", Duration::from_millis(1), 10),
        jobs::age_priorities(&mut conn, "q\0", Duration::from_millis(1), 10),
    ];
    for outcome in refused {
        assert!(
            matches!(outcome, Err(tenure::Error::InvalidInput { .. })),
            "{outcome:?}"
        );
    }
    let worker = Worker::builder(db.pool(8))
        .queue("q")
        .raw_handler("a", |_: &JobContext, _: &[u8]| Ok(()))
        .age_priorities(Duration::ZERO)
        .start();
    assert!(matches!(worker, Err(tenure::Error::InvalidInput { .. })));
    assert_eq!(jobs::get(&mut conn, id).unwrap().unwrap().priority, 5);
}

/// A worker built with `age_priorities` runs a low-priority job while a producer keeps its
/// only thread busy with urgent ones (each run enqueues the next two), and reports the
/// aging as an event.
fn a_worker_ages_its_queues_and_runs_the_starved_job(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let low = enqueue_id(&mut conn, NewJob::new("q", "low", vec![]).priority(LOW));
    for _ in 0..20 {
        enqueue_id(
            &mut conn,
            NewJob::new("q", "urgent", vec![]).priority(URGENT),
        );
    }
    let aged = Arc::new(AtomicUsize::new(0));
    let seen = aged.clone();
    let pool = db.pool(8);
    let producer = pool.clone();
    let handle = Worker::builder(pool)
        .queue("q")
        .threads(1)
        .prefetch(0)
        .raw_handler("urgent", move |_: &JobContext, _: &[u8]| {
            let mut c = producer.get()?;
            std::thread::sleep(Duration::from_millis(5));
            jobs::enqueue(
                &mut *c,
                &NewJob::new("q", "urgent", vec![]).priority(URGENT),
            )?;
            Ok(())
        })
        .raw_handler("low", |_: &JobContext, _: &[u8]| Ok(()))
        .age_priorities(Duration::from_millis(300))
        .on_event(move |event| {
            if let Event::Aged { jobs, .. } = event {
                seen.fetch_add(*jobs, Ordering::SeqCst);
            }
        })
        .start()
        .unwrap();
    wait_until("the starved job to run", Duration::from_secs(40), || {
        (jobs::get(&mut conn, low).unwrap().unwrap().state == JobState::Completed).then_some(())
    });
    handle.shutdown(Duration::from_secs(10));
    assert!(aged.load(Ordering::SeqCst) >= 1, "no Aged event");
    let urgent_waiting = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = 'urgent' AND state = 'waiting'",
    );
    assert!(
        urgent_waiting > 0,
        "the urgent stream ran dry: the test showed nothing"
    );
}

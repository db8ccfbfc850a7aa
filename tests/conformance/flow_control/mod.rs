//! Flow control: rate limits, several limits per job, queue-wide concurrency limits, all
//! decided inside the claim and counted on the database's clock.

mod limits;
mod mixed_limits;
mod queue_limits;
mod wider_pick;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, TimeDelta, Utc};
use tenure::Backend;
use tenure::jobs::{self, Limit, NewJob, Outcome};

use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    a_rate_limit_holds_in_every_window_while_unlimited_jobs_drain,
    several_keys_per_job_are_never_exceeded,
    a_queue_wide_limit_holds_under_eight_claimers,
    a_throttled_key_is_claimable_again_when_its_window_allows,
    a_rate_counts_retries_as_starts,
    limits_are_stored_with_the_job_and_pruned_with_it,
    bad_flow_control_input_is_refused_and_writes_nothing,
    a_keys_starts_are_trimmed_to_what_any_rate_can_need,
    a_worker_claims_a_throttled_key_when_its_window_allows_not_at_its_next_poll,
);

const TTL: Duration = Duration::from_secs(120);

/// Each claimed job's kind and start instant.
type Starts = Vec<(String, DateTime<Utc>)>;

/// The most instants of `starts` (sorted) inside any half-open window `[t, t + width)`.
pub fn fullest_window(starts: &[DateTime<Utc>], width: TimeDelta) -> usize {
    let mut most = 0;
    let mut first = 0;
    for (last, at) in starts.iter().enumerate() {
        while *at - starts[first] >= width {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most
}

/// 300 jobs limited to 50 starts a second on one key and 300 unlimited jobs, in one queue,
/// drained by 8 claimers on their own connections. From the claims' `claimed_at` (the
/// database's clock): no window of one second holds more than 50 starts of the key; and the
/// unlimited jobs all started while the limited ones still had half of their 6 seconds to go
/// (the limited ones never crowd them out).
fn a_rate_limit_holds_in_every_window_while_unlimited_jobs_drain(backend: Backend) {
    const LIMITED: usize = 300;
    const FREE: usize = 300;
    const RATE: u32 = 50;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut batch = Vec::new();
    for i in 0..LIMITED.max(FREE) {
        if i < LIMITED {
            batch.push(NewJob::new("rated", "limited", vec![]).rate_limit(
                "provider",
                RATE,
                Duration::from_secs(1),
            ));
        }
        if i < FREE {
            batch.push(NewJob::new("rated", "free", vec![]));
        }
    }
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let starts: Arc<Mutex<Starts>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let mut conn = db.connect();
            let (starts, done) = (starts.clone(), done.clone());
            std::thread::spawn(move || {
                // 6 s of starts at the least; wide room for a loaded machine.
                let until = Clock::now() + Duration::from_secs(240);
                while done.load(Ordering::SeqCst) < LIMITED + FREE && Clock::now() < until {
                    let claimed = jobs::claim(&mut conn, "rated", 20, TTL).expect("claim");
                    if claimed.is_empty() {
                        // Eight pollers keep claiming at 320 a second: every window is
                        // tried often (the polls, not the jobs, were the test's CPU).
                        std::thread::sleep(Duration::from_millis(25));
                        continue;
                    }
                    starts
                        .lock()
                        .unwrap()
                        .extend(claimed.iter().map(|j| (j.kind.clone(), j.claimed_at)));
                    let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
                    let outcomes = jobs::complete(&mut conn, &claims).expect("complete");
                    assert!(outcomes.iter().all(|o| *o == Outcome::Done));
                    done.fetch_add(claimed.len(), Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a claimer failed");
    }
    let starts = starts.lock().unwrap();
    let mut limited: Vec<DateTime<Utc>> = starts
        .iter()
        .filter(|(kind, _)| kind == "limited")
        .map(|(_, at)| *at)
        .collect();
    let mut free: Vec<DateTime<Utc>> = starts
        .iter()
        .filter(|(kind, _)| kind == "free")
        .map(|(_, at)| *at)
        .collect();
    assert_eq!(
        (limited.len(), free.len()),
        (LIMITED, FREE),
        "every job ran once"
    );
    limited.sort_unstable();
    free.sort_unstable();
    let most = fullest_window(&limited, TimeDelta::seconds(1));
    assert!(
        most <= RATE as usize,
        "{most} starts of the limited key in one second (limit {RATE})"
    );
    // 300 at 50 a second take at least 5 s; the unlimited ones must not wait for them.
    let span = *limited.last().unwrap() - limited[0];
    assert!(
        span >= TimeDelta::seconds(5),
        "the limited key ran in {span}"
    );
    let halfway = limited[LIMITED / 2];
    assert!(
        *free.last().unwrap() < halfway,
        "the last unlimited job started at {}, after half of the limited ones ({halfway})",
        free.last().unwrap()
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'"
        ),
        0
    );
}

/// Jobs carrying keys {a, b}, {a} or {b}, with a at most 1 running and b at most 2, under 8
/// claimers: neither cap is ever exceeded (counted by the claimers, which stop counting a
/// job before completing it), and every job runs once.
fn several_keys_per_job_are_never_exceeded(backend: Backend) {
    const EACH: usize = 40;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut batch = Vec::new();
    for _ in 0..EACH {
        batch.push(
            NewJob::new("multi", "ab", vec![])
                .with_limit(Limit::concurrency("a", 1))
                .with_limit(Limit::concurrency("b", 2)),
        );
        batch.push(NewJob::new("multi", "a", vec![]).limit("a", 1));
        batch.push(NewJob::new("multi", "b", vec![]).limit("b", 2));
    }
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let running: Arc<Mutex<HashMap<char, usize>>> = Arc::default();
    let most: Arc<Mutex<HashMap<char, usize>>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let mut conn = db.connect();
            let (running, most, done) = (running.clone(), most.clone(), done.clone());
            std::thread::spawn(move || {
                let until = Clock::now() + Duration::from_secs(120);
                while done.load(Ordering::SeqCst) < 3 * EACH && Clock::now() < until {
                    let claimed = jobs::claim(&mut conn, "multi", 3, TTL).expect("claim");
                    if claimed.is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    for job in &claimed {
                        let mut r = running.lock().unwrap();
                        let mut m = most.lock().unwrap();
                        for key in job.kind.chars() {
                            let n = r.entry(key).or_default();
                            *n += 1;
                            let top = m.entry(key).or_default();
                            *top = (*top).max(*n);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(3 + (t as u64 % 3) * 3));
                    for job in &claimed {
                        {
                            let mut r = running.lock().unwrap();
                            for key in job.kind.chars() {
                                *r.get_mut(&key).unwrap() -= 1;
                            }
                        }
                        let outcome = jobs::complete(&mut conn, &[job.claim()]).unwrap();
                        assert_eq!(outcome, vec![Outcome::Done]);
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a claimer failed");
    }
    let most = most.lock().unwrap();
    assert!(most[&'a'] <= 1, "a ran {} at once (cap 1)", most[&'a']);
    assert!(most[&'b'] <= 2, "b ran {} at once (cap 2)", most[&'b']);
    assert_eq!(done.load(Ordering::SeqCst), 3 * EACH, "every job ran");
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state <> 'completed'"
        ),
        0
    );
}

/// A queue limited to 3 running jobs, 8 claimers asking for up to 4 each: never more than 3
/// run at once, whatever their keys (here none), and every job runs.
fn a_queue_wide_limit_holds_under_eight_claimers(backend: Backend) {
    const JOBS: usize = 150;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::limit_queue(&mut conn, "capped", Some(3)).unwrap();
    let batch: Vec<NewJob> = (0..JOBS)
        .map(|_| NewJob::new("capped", "work", vec![]))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let mut conn = db.connect();
            let (running, most, done) = (running.clone(), most.clone(), done.clone());
            std::thread::spawn(move || {
                let until = Clock::now() + Duration::from_secs(120);
                while done.load(Ordering::SeqCst) < JOBS && Clock::now() < until {
                    let claimed = jobs::claim(&mut conn, "capped", 4, TTL).expect("claim");
                    if claimed.is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    let now = running.fetch_add(claimed.len(), Ordering::SeqCst) + claimed.len();
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(5));
                    running.fetch_sub(claimed.len(), Ordering::SeqCst);
                    let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
                    jobs::complete(&mut conn, &claims).unwrap();
                    done.fetch_add(claimed.len(), Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a claimer failed");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 3, "{most} jobs of the queue ran at once (limit 3)");
    assert_eq!(done.load(Ordering::SeqCst), JOBS);
    // Cleared, the queue is unlimited again.
    jobs::limit_queue(&mut conn, "capped", None).unwrap();
    assert!(jobs::queue_limits(&mut conn).unwrap().is_empty());
    for _ in 0..5 {
        jobs::enqueue(&mut conn, &NewJob::new("capped", "work", vec![])).unwrap();
    }
    assert_eq!(jobs::claim(&mut conn, "capped", 10, TTL).unwrap().len(), 5);
}

/// A key at 2 starts per 1.5 s: the third job stays waiting (and says so in `key_states`)
/// while an unlimited job behind it is claimed, and is claimed once the window allows, with
/// no pass in between: a claim decides.
fn a_throttled_key_is_claimable_again_when_its_window_allows(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let per = Duration::from_millis(1500);
    for _ in 0..3 {
        jobs::enqueue(
            &mut conn,
            &NewJob::new("t", "limited", vec![]).rate_limit("k", 2, per),
        )
        .unwrap();
    }
    let free = jobs::enqueue(&mut conn, &NewJob::new("t", "free", vec![]).priority(1))
        .unwrap()
        .id;
    let first = jobs::claim(&mut conn, "t", 10, TTL).unwrap();
    let kinds: Vec<&str> = first.iter().map(|j| j.kind.as_str()).collect();
    assert_eq!(kinds, vec!["limited", "limited", "free"]);
    assert_eq!(first[2].id, free);
    let states = jobs::key_states(&mut conn, 100).unwrap();
    let until = states
        .iter()
        .find(|s| s.key == "k")
        .and_then(|s| s.throttled_until)
        .expect("k is throttled");
    let last_start = first[0].claimed_at.max(first[1].claimed_at);
    assert!(
        until >= last_start,
        "throttled until {until}, before the starts ({last_start})"
    );
    assert!(jobs::claim(&mut conn, "t", 10, TTL).unwrap().is_empty());
    // Wait on the database's clock until the window allows, then one claim takes it.
    poll_until(Duration::from_secs(60), Duration::from_millis(50), || {
        (tenure::database_now(&mut conn).unwrap() >= until).then_some(())
    })
    .unwrap_or_else(|| panic!("the database clock did not reach {until}"));
    let third = jobs::claim(&mut conn, "t", 10, TTL).unwrap();
    assert_eq!(third.len(), 1);
    assert!(
        third[0].claimed_at - first[0].claimed_at.min(first[1].claimed_at)
            >= TimeDelta::milliseconds(1500)
    );
}

/// A retry is a start: a job that fails is held back by its own first start, so a failing
/// job cannot bypass the rate.
fn a_rate_counts_retries_as_starts(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let per = Duration::from_secs(3600);
    let job = NewJob::new("r", "k", vec![]).rate_limit("once-an-hour", 1, per);
    jobs::enqueue(&mut conn, &job).unwrap();
    let claimed = jobs::claim(&mut conn, "r", 1, TTL).unwrap();
    assert_eq!(claimed.len(), 1);
    // Retried at once: due, but its key's hour holds a start already.
    let retry = jobs::Retry::At(chrono::DateTime::<Utc>::from_timestamp(0, 0).unwrap());
    jobs::fail(&mut conn, claimed[0].claim(), "boom", retry).unwrap();
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'"
        ),
        1
    );
    assert!(jobs::claim(&mut conn, "r", 1, TTL).unwrap().is_empty());
    jobs::enqueue(&mut conn, &job).unwrap();
    assert!(jobs::claim(&mut conn, "r", 10, TTL).unwrap().is_empty());
}

/// `limits_of` reads back what was enqueued (both caps of a key merged); prune deletes a
/// finished job's limits with it.
fn limits_are_stored_with_the_job_and_pruned_with_it(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let job = NewJob::new("s", "k", vec![])
        .limit("a", 2)
        .rate_limit("a", 5, Duration::from_secs(1))
        .rate_limit("b", 7, Duration::from_millis(250));
    let id = jobs::enqueue(&mut conn, &job).unwrap().id;
    let many =
        jobs::enqueue_many(&mut conn, &[job.clone(), NewJob::new("s", "k", vec![])]).unwrap();
    for id in [id, many[0].id] {
        let limits = jobs::limits_of(&mut conn, id).unwrap();
        assert_eq!(limits.len(), 2);
        assert_eq!(limits[0].key(), "a");
        assert_eq!(limits[0].max_running(), Some(2));
        assert_eq!(
            limits[0].rate_cap().map(|r| (r.max, r.per)),
            Some((5, Duration::from_secs(1)))
        );
        assert_eq!(
            limits[1].rate_cap().map(|r| r.per),
            Some(Duration::from_millis(250))
        );
    }
    assert!(jobs::limits_of(&mut conn, many[1].id).unwrap().is_empty());
    let stored = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(
        (stored.limit_key.as_deref(), stored.limit_max),
        (Some("a"), Some(2))
    );
    for claimed in jobs::claim(&mut conn, "s", 10, TTL).unwrap() {
        jobs::complete(&mut conn, &[claimed.claim()]).unwrap();
    }
    let policy = jobs::Retention::DeleteAll;
    jobs::prune(&mut conn, "s", jobs::Finished::Completed, policy, 100).unwrap();
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_limits"),
        0
    );
}

/// Out-of-range caps, periods, too many keys, an empty key: a typed error, nothing written.
fn bad_flow_control_input_is_refused_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let second = Duration::from_secs(1);
    let bad = [
        NewJob::new("q", "k", vec![]).limit("a", 0),
        NewJob::new("q", "k", vec![]).limit("a", 10_001),
        NewJob::new("q", "k", vec![]).rate_limit("a", 0, second),
        NewJob::new("q", "k", vec![]).rate_limit("a", 10_001, second),
        NewJob::new("q", "k", vec![]).rate_limit("a", 1, Duration::ZERO),
        NewJob::new("q", "k", vec![]).rate_limit("a", 1, Duration::from_micros(999)),
        NewJob::new("q", "k", vec![]).rate_limit("a", 1, Duration::from_secs(367 * 86_400)),
        NewJob::new("q", "k", vec![]).rate_limit("", 1, second),
        NewJob::new("q", "k", vec![]).limit("a\0b", 1),
        (0..9).fold(NewJob::new("q", "k", vec![]), |job, i| {
            job.limit(format!("k{i}"), 1)
        }),
    ];
    for job in &bad {
        let err = jobs::enqueue(&mut conn, job).unwrap_err();
        assert!(
            matches!(err, tenure::Error::InvalidInput { .. }),
            "{job:?}: {err}"
        );
        let err = jobs::enqueue_many(&mut conn, std::slice::from_ref(job)).unwrap_err();
        assert!(matches!(err, tenure::Error::InvalidInput { .. }), "{err}");
    }
    for max in [Some(0), Some(10_001)] {
        let err = jobs::limit_queue(&mut conn, "q", max).unwrap_err();
        assert!(matches!(err, tenure::Error::InvalidInput { .. }), "{err}");
    }
    assert!(jobs::limit_queue(&mut conn, "", Some(1)).is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_limits"),
        0
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_queue_limits"),
        0
    );
    // Eight keys is the most, and fine.
    let eight = (0..8).fold(NewJob::new("q", "k", vec![]), |job, i| {
        job.limit(format!("k{i}"), 1)
    });
    jobs::enqueue(&mut conn, &eight).unwrap();
}

/// 20,000 starts of one key (a rate that never fills: 10,000 per millisecond): the key keeps
/// its newest 10,000 (the most any rate can need), trimmed once it holds 20,000; and a rate
/// declared afterwards with a long period (10,000 an hour) still finds its window full.
fn a_keys_starts_are_trimmed_to_what_any_rate_can_need(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let fast = NewJob::new("trim", "k", vec![]).rate_limit("k", 10_000, Duration::from_millis(1));
    for _ in 0..2 {
        jobs::enqueue_many(&mut conn, &vec![fast.clone(); 10_000]).unwrap();
    }
    let mut started = 0;
    while started < 20_000 {
        let claimed = jobs::claim(&mut conn, "trim", 1000, TTL).unwrap();
        assert!(!claimed.is_empty(), "claimed {started} of 20,000");
        started += claimed.len();
    }
    let kept = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_limit_starts");
    assert_eq!(kept, 10_000, "starts kept after 20,000");
    assert_eq!(
        count(&mut conn, "SELECT starts_kept AS n FROM tenure_limit_keys"),
        10_000
    );
    let hourly =
        NewJob::new("trim", "k", vec![]).rate_limit("k", 10_000, Duration::from_secs(3600));
    jobs::enqueue(&mut conn, &hourly).unwrap();
    assert!(jobs::claim(&mut conn, "trim", 10, TTL).unwrap().is_empty());
}

/// A worker polling at most every 30 s when idle, 6 jobs at 3 starts per 6 s: the second
/// three start when the window allows (6 s after the first), because the claim tells the
/// worker when the rate frees; not at the idle wait's next doubling (10.2 s after the
/// first). Start instants are the claims' (database clock); the bound leaves 2.5 s for a
/// loaded machine.
fn a_worker_claims_a_throttled_key_when_its_window_allows_not_at_its_next_poll(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = pool.get().unwrap();
    let per = Duration::from_secs(6);
    let batch: Vec<NewJob> = (0..6)
        .map(|_| NewJob::new("paced", "tick", vec![]).rate_limit("paced", 3, per))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    let starts: Arc<Mutex<Vec<DateTime<Utc>>>> = Arc::default();
    let seen = starts.clone();
    let worker = tenure::worker::Worker::builder(pool.clone())
        .queue("paced")
        .threads(2)
        .poll_interval(Duration::from_secs(600))
        .raw_handler("tick", move |ctx: &tenure::worker::JobContext, _: &[u8]| {
            seen.lock().unwrap().push(ctx.claimed_at);
            Ok::<(), tenure::worker::JobError>(())
        })
        .start()
        .unwrap();
    poll_until(Duration::from_secs(50), Duration::from_millis(20), || {
        (worker.report().completed >= 6).then_some(())
    });
    worker.shutdown(Duration::from_secs(5));
    let mut starts = starts.lock().unwrap().clone();
    starts.sort_unstable();
    assert_eq!(starts.len(), 6, "every job ran");
    let gap = starts[3] - starts[0];
    assert!(
        gap >= TimeDelta::seconds(6),
        "the rate allowed the fourth start after {gap}"
    );
    assert!(
        // The idle poll is 600 s away: anything far below it (5x the window, for a loaded
        // machine) shows the worker woke for the window.
        gap < TimeDelta::seconds(30),
        "the fourth start came {gap} after the first: the worker waited for its idle poll"
    );
}

//! Flow control for jobs that share a key but declare different limits. `Limit`'s
//! documentation: "Jobs that share a key share its count: give them the same limits (where
//! they differ, each job is held to its own)."

use std::time::Duration;

use chrono::TimeDelta;
use tenure::Backend;
use tenure::jobs::{self, Limit, NewJob};

use crate::common::{TestDb, conformance, wait_for_db_clock};

conformance!(
    a_job_with_a_larger_cap_waits_for_a_smaller_capped_running_job_then_runs,
    a_job_without_a_rate_is_not_held_back_by_another_jobs_rate_on_its_key,
    a_job_with_a_short_rate_is_not_held_to_another_jobs_long_window,
    a_long_window_still_counts_starts_a_short_window_has_forgotten,
);

const TTL: Duration = Duration::from_secs(600);

/// Key `k`: job A (at most 1 running) runs; job B (at most 5 running) waits. Documented
/// (`Limit`): the pick counts a key full at the smallest cap among its running jobs, so B
/// waits while A runs (it is never admitted past its own cap), and is claimed as soon as A
/// finishes. Found by the attack as "B is held to A's cap"; kept as the documented rule
/// (comparing each job's own cap in the pick would cost every scanned row a count).
fn a_job_with_a_larger_cap_waits_for_a_smaller_capped_running_job_then_runs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).limit("k", 1))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![a]);
    let b = jobs::enqueue(&mut conn, &NewJob::new("q", "b", vec![]).limit("k", 5))
        .unwrap()
        .id;
    assert!(jobs::claim(&mut conn, "q", 10, TTL).unwrap().is_empty());
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();
    let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(claimed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![b]);
}

// Found by the round-18 attacks on flow control: jobs that share a key but declare different limits (attacks18.rs).
/// Key `k`: job R (1 start an hour) starts, so `k` is throttled for an hour. Job C carries
/// only a concurrency cap on `k` (at most 5 running, none running): no rate holds it back,
/// and admission would take it. The pick leaves out every job with any limit on a throttled
/// key, rate or not, so C waits an hour.
fn a_job_without_a_rate_is_not_held_back_by_another_jobs_rate_on_its_key(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let hour = Duration::from_secs(3600);
    jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "r", vec![]).rate_limit("k", 1, hour),
    )
    .unwrap();
    assert_eq!(jobs::claim(&mut conn, "q", 10, TTL).unwrap().len(), 1);
    let c = jobs::enqueue(&mut conn, &NewJob::new("q", "c", vec![]).limit("k", 5))
        .unwrap()
        .id;
    let claimed = jobs::claim_kinds(&mut conn, "q", &["c"], 10, TTL).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![c],
        "C (no rate, cap 5 on k, nothing running) was not claimed"
    );
}

// Found by the round-18 attacks on flow control: jobs that share a key but declare different limits (attacks18.rs).
/// Key `k`: job L (1 start an hour) starts; `throttled_until` becomes an hour from now. Job
/// S carries 100 starts a second on `k`. Once a second has passed since L's start, S's own
/// window holds no start, so a claim must take it; the hint computed from L's window keeps
/// it out of the pick for the hour.
fn a_job_with_a_short_rate_is_not_held_to_another_jobs_long_window(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "long", vec![]).rate_limit("k", 1, Duration::from_secs(3600)),
    )
    .unwrap();
    let long = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(long.len(), 1);
    let s = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "short", vec![]).rate_limit("k", 100, Duration::from_secs(1)),
    )
    .unwrap()
    .id;
    // Wide margin past S's one-second window (database clock).
    wait_for_db_clock(
        &mut conn,
        long[0].claimed_at + TimeDelta::milliseconds(1500),
    );
    let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![s],
        "S (100 a second, no start of k in the last second) was not claimed"
    );
}

// Found by the round-18 attacks on flow control: jobs that share a key but declare different limits (attacks18.rs).
/// Key `k`: jobs S (10 starts a second) start twice, 1.5 s apart; then job L (2 starts an
/// hour) is due. L's own window (the last hour) already holds 2 starts of `k`, so L must
/// wait. But each claim of S pruned the starts older than S's one-second window (the key's
/// stored horizon was S's period), so L's claim counts 1 start in its hour and admits L:
/// 3 starts of `k` in an hour, where L's limit allows 2.
fn a_long_window_still_counts_starts_a_short_window_has_forgotten(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let short = NewJob::new("q", "short", vec![]).rate_limit("k", 10, Duration::from_secs(1));
    jobs::enqueue(&mut conn, &short).unwrap();
    let first = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(first.len(), 1);
    wait_for_db_clock(
        &mut conn,
        first[0].claimed_at + TimeDelta::milliseconds(1500),
    );
    jobs::enqueue(&mut conn, &short).unwrap();
    let second = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(second.len(), 1);
    jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "long", vec![]).with_limit(Limit::rate(
            "k",
            2,
            Duration::from_secs(3600),
        )),
    )
    .unwrap();
    let third = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert!(
        third.is_empty(),
        "L (2 starts an hour) was claimed as the third start of k within the hour: \
         starts at {}, {}, {}",
        first[0].claimed_at,
        second[0].claimed_at,
        third[0].claimed_at
    );
}

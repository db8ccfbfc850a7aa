//! Instants at the edges: leap seconds, the last nanosecond of 9999, and a backoff without a
//! cap (refused as invalid input, writing nothing, or stored exactly).

use std::time::Duration;

use chrono::{DateTime, TimeZone, Timelike, Utc};
use tenure::Backend;
use tenure::jobs::{self, NewJob, Outcome, Retry};

use crate::common::{TestDb, conformance};

conformance!(
    leap_second_instants_are_stored_or_refused_as_invalid_input,
    the_last_nanosecond_of_9999_is_stored_as_year_9999,
    an_uncapped_backoff_refuses_only_invalid_input_and_writes_nothing,
);

const TTL: Duration = Duration::from_secs(60);

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

/// chrono represents a leap second as nanoseconds past 1e9. Such an instant, within years 1
/// to 9999, enters through NewJob::at and Retry::At: it must be stored (as some instant of
/// that second) or refused as invalid input, never a database error or a corrupt row.
fn leap_second_instants_are_stored_or_refused_as_invalid_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let leap = utc(2016, 12, 31, 23, 59, 59)
        .with_nanosecond(1_500_000_000)
        .expect("a leap second");
    let mut failures = Vec::new();
    match jobs::enqueue(&mut conn, &NewJob::new("q", "leap", vec![]).at(leap)) {
        Err(e) if e.is_invalid_input() => {}
        Err(e) => failures.push(format!("enqueue at {leap:?}: {e:?}")),
        Ok(enqueued) => match jobs::get(&mut conn, enqueued.id) {
            Err(e) => failures.push(format!("enqueue accepted it; reading the job back: {e:?}")),
            Ok(job) => {
                let job = job.unwrap();
                let secs = job.due_at.timestamp();
                if !(utc(2016, 12, 31, 23, 59, 59).timestamp()
                    ..=utc(2017, 1, 1, 0, 0, 0).timestamp())
                    .contains(&secs)
                {
                    failures.push(format!("stored as {}", job.due_at));
                }
            }
        },
    }
    if let Err(e) = jobs::stats(&mut conn) {
        failures.push(format!("stats after it: {e:?}"));
    }
    if let Err(e) = jobs::claim(&mut conn, "q", 10, TTL) {
        failures.push(format!("claim on its queue after it: {e:?}"));
    }
    let mut conn2 = db.connect();
    let holder = jobs::enqueue(&mut conn2, &NewJob::new("r", "k", vec![])).unwrap();
    let job = jobs::claim(&mut conn2, "r", 1, TTL).unwrap().pop().unwrap();
    assert_eq!(job.id, holder.id);
    match jobs::fail(&mut conn2, job.claim(), "boom", Retry::At(leap)) {
        Err(e) if e.is_invalid_input() => {}
        Err(e) => failures.push(format!("fail with retry at {leap:?}: {e:?}")),
        Ok(_) => {
            if let Err(e) = jobs::get(&mut conn2, job.id) {
                failures.push(format!(
                    "fail accepted Retry::At(leap second); reading the job: {e:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The last representable nanosecond of year 9999 is inside the range: it is stored as an
/// instant of year 9999 (never rounded up into year 10000) and is never due.
fn the_last_nanosecond_of_9999_is_stored_as_year_9999(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let last = utc(9999, 12, 31, 23, 59, 59) + chrono::Duration::nanoseconds(999_999_999);
    let job = jobs::enqueue(&mut conn, &NewJob::new("q", "late", vec![]).at(last)).unwrap();
    let stored = jobs::get(&mut conn, job.id).unwrap().unwrap();
    assert_eq!(
        stored.due_at.timestamp(),
        utc(9999, 12, 31, 23, 59, 59).timestamp()
    );
    assert!(jobs::claim(&mut conn, "q", 1, TTL).unwrap().is_empty());
    jobs::stats(&mut conn).expect("stats read every stored instant");
    let first = utc(1, 1, 1, 0, 0, 0) + chrono::Duration::nanoseconds(1);
    let early = jobs::enqueue(&mut conn, &NewJob::new("q", "early", vec![]).at(first)).unwrap();
    let claimed = jobs::claim(&mut conn, "q", 10, TTL).unwrap();
    assert_eq!(
        claimed.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![early.id]
    );
}

/// A backoff with no cap (max = Duration::MAX) is accepted by fail for early attempts; once
/// its delay passes 366 days it must either be clamped or refused as invalid input, and in the
/// latter case the claim is left as it was.
fn an_uncapped_backoff_refuses_only_invalid_input_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]).max_attempts(5))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "q", 1, TTL).unwrap().pop().unwrap();
    assert_eq!(job.id, id);
    let backoff = jobs::Backoff {
        base: Duration::from_secs(400 * 86400),
        max: Duration::MAX,
    };
    match jobs::fail(&mut conn, job.claim(), "boom", Retry::Backoff(backoff)) {
        Ok(outcome) => {
            assert_eq!(outcome, Outcome::Done);
            let stored = jobs::get(&mut conn, id).unwrap().unwrap();
            assert_eq!(stored.state, jobs::JobState::Waiting);
        }
        Err(e) => {
            assert!(e.is_invalid_input(), "{e:?}");
            let stored = jobs::get(&mut conn, id).unwrap().unwrap();
            assert_eq!(stored.state, jobs::JobState::Running);
            assert_eq!(stored.last_error, None);
        }
    }
}

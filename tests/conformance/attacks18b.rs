//! Attacks on uniqueness over time (round 18b): dedup windows and the OnDuplicate modes
//! against schedules, kinds and concurrent pruning.

use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, Utc};
use dibs::Backend;
use dibs::jobs::{self, DedupOver, NewJob, OnDuplicate};
use dibs::schedules::{self, Schedule};

use crate::support::{TestDb, conformance, count};

conformance!(
    a_schedule_never_drops_its_jobs_dedup_window_silently,
    replace_never_gives_a_job_the_payload_meant_for_another_kind,
);

const TTL: Duration = Duration::from_secs(600);

/// Sleeps until the database's clock is past `at` (60 s at most).
fn wait_for_db_clock(conn: &mut dibs::AnyConnection, at: DateTime<Utc>) {
    let deadline = Clock::now() + Duration::from_secs(60);
    while dibs::database_now(conn).unwrap() <= at {
        assert!(Clock::now() < deadline, "the database clock did not pass {at}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

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
            assert!(schedules::list(&mut conn).unwrap().is_empty(), "refused but written");
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
        "SELECT COUNT(*) AS n FROM dibs_jobs WHERE dedup_key = 'nightly'",
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
        pair == ("resize_image", &b"{\"image\":7}"[..]) || pair == ("send_email", &b"{\"to\":\"a@b\"}"[..]),
        "{backend}: kind {:?} with payload {:?} (answer {second:?})",
        job.kind,
        String::from_utf8_lossy(&job.payload)
    );
}

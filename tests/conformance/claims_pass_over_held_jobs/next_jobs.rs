//! A claim whose jobs ahead are held by other transactions takes the next ones instead, within
//! the same limits: a claim of one never comes back empty while the job ahead is held and
//! others wait (PostgreSQL's mark passes a held job over and the claim picks again for its
//! room, `jobs::queue::claim`), a capped key's room goes to the job nobody holds, and rate
//! starts count only the jobs claimed. The servers only (SQLite's claim waits for any other
//! writer by design).

use std::sync::mpsc;
use std::time::Duration;

use diesel::Connection;
use tenure::jobs::{self, NewJob, OnDuplicate};
use tenure::{AnyConnection, Backend};

use super::{BLOCKED, TTL, claim_beside, hold, ids};
use crate::common::{TestDb, count, enqueue_id, on_servers};

on_servers!(
    a_claim_of_one_takes_the_next_job_when_the_first_is_held,
    a_claim_of_one_passes_over_a_job_a_callers_open_fold_holds,
    a_held_job_at_the_head_of_a_capped_key_leaves_the_key_to_the_next,
    rate_starts_are_recorded_only_for_the_jobs_claimed,
);

/// Three waiting jobs; another transaction locks the first in claim order. A claim of ONE
/// must take the second (the promise: "it takes the others"), not come back empty while
/// others wait: a worker claiming one at a time would otherwise see an empty queue for as
/// long as the holder holds the head job.
fn a_claim_of_one_takes_the_next_job_when_the_first_is_held(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let ids3: Vec<i64> = (0..3u8)
        .map(|i| enqueue_id(&mut conn, NewJob::new("held1", "work", vec![i])))
        .collect();
    let holder = hold(&db, ids3[0]);
    let (mut conn, claimed) = claim_beside(holder, conn, |c| {
        jobs::claim(c, "held1", 1, TTL).expect("the claim succeeds")
    });
    assert_eq!(
        ids(&claimed),
        vec![ids3[1]],
        "a claim of one took the next job nobody holds"
    );
    let rest = jobs::claim(&mut conn, "held1", 10, TTL).unwrap();
    assert_eq!(ids(&rest), vec![ids3[0], ids3[2]], "nothing lost");
}

/// The same through tenure's own API: a caller's transaction folds a duplicate into the
/// first waiting job (`OnDuplicate::Keep`: its dedup count goes up, nothing the ring lists
/// changes) and stays open. A claim of one beside it must take the second job.
fn a_claim_of_one_passes_over_a_job_a_callers_open_fold_holds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let first = enqueue_id(
        &mut conn,
        NewJob::new("held2", "work", vec![0]).dedup_key("d0"),
    );
    let second = enqueue_id(
        &mut conn,
        NewJob::new("held2", "work", vec![1]).dedup_key("d1"),
    );
    let mut caller = db.connect();
    let (folded, fold_done) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let folder = std::thread::spawn(move || {
        caller
            .transaction::<_, tenure::Error, _>(|c| {
                let again = jobs::enqueue(
                    c,
                    &NewJob::new("held2", "work", vec![9])
                        .dedup_key("d0")
                        .on_duplicate(OnDuplicate::Keep),
                )?;
                folded.send(again.id).unwrap();
                released.recv_timeout(BLOCKED * 2).ok();
                Ok(())
            })
            .unwrap();
        caller
    });
    assert_eq!(fold_done.recv_timeout(BLOCKED).unwrap(), first, "folded");
    let (sent, got) = mpsc::channel();
    let claimer = std::thread::spawn(move || {
        let claimed = jobs::claim(&mut conn, "held2", 1, TTL).expect("the claim succeeds");
        sent.send(()).unwrap();
        (conn, claimed)
    });
    let returned = got.recv_timeout(BLOCKED).is_ok();
    release.send(()).unwrap();
    folder.join().unwrap();
    let (mut conn, claimed) = claimer.join().unwrap();
    assert!(returned, "the claim waited for the caller's fold");
    assert_eq!(
        ids(&claimed),
        vec![second],
        "a claim of one took the job the caller's transaction does not hold"
    );
    let rest = jobs::claim(&mut conn, "held2", 10, TTL).unwrap();
    assert_eq!(ids(&rest), vec![first], "nothing lost");
}

/// Two waiting jobs of a key capped at one; another transaction holds the first. A claim
/// of ten must take the second: the key has room for one and only one job is claimable.
fn a_held_job_at_the_head_of_a_capped_key_leaves_the_key_to_the_next(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue_id(
        &mut conn,
        NewJob::new("held3", "work", vec![0]).limit("k", 1),
    );
    let b = enqueue_id(
        &mut conn,
        NewJob::new("held3", "work", vec![1]).limit("k", 1),
    );
    let holder = hold(&db, a);
    let (mut conn, claimed) = claim_beside(holder, conn, |c| {
        jobs::claim(c, "held3", 10, TTL).expect("the claim succeeds")
    });
    assert_eq!(
        ids(&claimed),
        vec![b],
        "the key's room went to the job nobody holds"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running'"
        ),
        1,
        "the cap of one holds"
    );
}

/// A rate of two an hour over three jobs; another transaction holds the first when the
/// first claim runs. Whatever the claim takes, the starts recorded are exactly the jobs
/// claimed (PostgreSQL's mark may claim fewer than admission admitted: a start recorded for
/// the held job would fill the window with a run that never began), and over both claims
/// exactly two jobs run.
fn rate_starts_are_recorded_only_for_the_jobs_claimed(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let per = Duration::from_secs(3600);
    let all: Vec<i64> = (0..3u8)
        .map(|i| {
            enqueue_id(
                &mut conn,
                NewJob::new("held4", "work", vec![i]).rate_limit("r", 2, per),
            )
        })
        .collect();
    let holder = hold(&db, all[0]);
    let (mut conn, first) = claim_beside(holder, conn, |c| {
        jobs::claim(c, "held4", 10, TTL).expect("the claim succeeds")
    });
    let starts = |conn: &mut AnyConnection| {
        count(
            conn,
            "SELECT COUNT(*) AS n FROM tenure_limit_starts WHERE limit_key = 'r'",
        )
    };
    assert!(!ids(&first).contains(&all[0]), "the held job was claimed");
    assert_eq!(
        starts(&mut conn),
        first.len() as i64,
        "starts recorded for the first claim's jobs only: claimed {:?}",
        ids(&first)
    );
    let second = jobs::claim(&mut conn, "held4", 10, TTL).unwrap();
    assert_eq!(
        starts(&mut conn),
        (first.len() + second.len()) as i64,
        "starts recorded for the claimed jobs only"
    );
    assert_eq!(
        first.len() + second.len(),
        2,
        "the rate's two starts went to two runs: first {:?}, second {:?}",
        ids(&first),
        ids(&second)
    );
}

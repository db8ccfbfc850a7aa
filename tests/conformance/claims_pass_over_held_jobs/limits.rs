//! The claim's rounds (PostgreSQL's mark passes held jobs over and the claim picks again,
//! `jobs::queue::claim`), one claim at a time: the queue's limit, a key's cap (the smallest
//! among its running jobs) and a key's rate hold across the rounds; a claim returns each job
//! once, at most `max_jobs`, in claim order, the claim of kinds alike; many held jobs at the
//! head never make a claim fail, and nothing is lost once they are let go. Racing claims:
//! `limit_races`.

use std::collections::HashMap;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{QueryableByName, RunQueryDsl};
use tenure::jobs::{self, ClaimedJob, JobClaim, NewJob};
use tenure::{AnyConnection, Backend};

use super::{TTL, claim_beside, hold, ids};
use crate::common::{TestDb, count, enqueue_id, on_servers};

on_servers!(
    rounds_return_the_jobs_in_claim_order,
    rounds_of_a_claim_of_kinds_return_the_jobs_in_claim_order,
    a_queue_limit_holds_across_the_rounds_of_a_claim,
    the_smallest_cap_among_a_keys_running_jobs_holds_across_rounds,
    a_rate_holds_across_rounds_and_counts_only_the_jobs_claimed,
    more_held_jobs_than_eight_rounds_pass_never_fail_a_claim,
);

/// The claimed ids in the order the claim returned them.
fn in_order(jobs: &[ClaimedJob]) -> Vec<i64> {
    jobs.iter().map(|j| j.id).collect()
}

/// Holds every job of `held` (a transaction each); the claim runs beside them all (the first
/// one's holder is `claim_beside`'s), then every holder rolls back.
fn claim_beside_all(
    db: &TestDb,
    conn: AnyConnection,
    held: &[i64],
    claim: impl FnOnce(&mut AnyConnection) -> Vec<ClaimedJob> + Send + 'static,
) -> (AnyConnection, Vec<ClaimedJob>) {
    let mut holders: Vec<AnyConnection> = held.iter().map(|id| hold(db, *id)).collect();
    let first = holders.remove(0);
    let out = claim_beside(first, conn, claim);
    for mut h in holders {
        h.batch_execute("ROLLBACK").unwrap();
    }
    out
}

/// Three jobs by priority: A (capped at one on `k`, held), B (capped at one on `k`), C (no
/// limit). Claim order: A, B, C. A claim of ten takes B and C and must return them in claim
/// order, B first: round one admits A and C (B refused: A took the key's room) and marks
/// C; round two admits B.
fn rounds_return_the_jobs_in_claim_order(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue_id(
        &mut conn,
        NewJob::new("order", "work", vec![0])
            .priority(0)
            .limit("k", 1),
    );
    let b = enqueue_id(
        &mut conn,
        NewJob::new("order", "work", vec![1])
            .priority(1)
            .limit("k", 1),
    );
    let c = enqueue_id(&mut conn, NewJob::new("order", "work", vec![2]).priority(2));
    let (mut conn, got) = claim_beside_all(&db, conn, &[a], |c| {
        jobs::claim(c, "order", 10, TTL).expect("the claim succeeds")
    });
    assert_eq!(ids(&got), vec![b, c], "the jobs nobody holds");
    assert_eq!(
        in_order(&got),
        vec![b, c],
        "returned in claim order (priority {} before {})",
        got.iter().find(|j| j.id == b).unwrap().priority,
        got.iter().find(|j| j.id == c).unwrap().priority,
    );
    let after = jobs::claim(&mut conn, "order", 10, TTL).unwrap();
    assert!(after.is_empty(), "the key is full: {:?}", ids(&after));
}

/// The same through `claim_kinds`, over two kinds (one pick per kind, merged).
fn rounds_of_a_claim_of_kinds_return_the_jobs_in_claim_order(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue_id(
        &mut conn,
        NewJob::new("order", "x", vec![0]).priority(0).limit("k", 1),
    );
    let b = enqueue_id(
        &mut conn,
        NewJob::new("order", "y", vec![1]).priority(1).limit("k", 1),
    );
    let c = enqueue_id(&mut conn, NewJob::new("order", "x", vec![2]).priority(2));
    let d = enqueue_id(&mut conn, NewJob::new("order", "y", vec![3]).priority(3));
    let (_conn, got) = claim_beside_all(&db, conn, &[a], |c| {
        jobs::claim_kinds(c, "order", &["x", "y"], 10, TTL).expect("the claim succeeds")
    });
    assert_eq!(ids(&got), vec![b, c, d], "the jobs nobody holds");
    assert_eq!(in_order(&got), vec![b, c, d], "returned in claim order");
}

/// A queue limited to three with one job running; the three jobs at its head are held. A
/// claim of ten (rounds: the mark passes the three over) takes two, never a third; again
/// beside the holders it takes none; once they let go, none either (the queue is full).
fn a_queue_limit_holds_across_the_rounds_of_a_claim(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::limit_queue(&mut conn, "ql", Some(3)).unwrap();
    enqueue_id(&mut conn, NewJob::new("ql", "work", vec![]).priority(-1));
    let first = jobs::claim(&mut conn, "ql", 1, TTL).unwrap();
    assert_eq!(first.len(), 1);
    let waiting: Vec<i64> = (0..8u8)
        .map(|i| enqueue_id(&mut conn, NewJob::new("ql", "work", vec![i])))
        .collect();
    let running = |conn: &mut AnyConnection| {
        count(
            conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'ql' AND state = 'running'",
        )
    };
    let (mut conn, got) = claim_beside_all(&db, conn, &waiting[..3], |c| {
        jobs::claim(c, "ql", 10, TTL).expect("the claim succeeds")
    });
    assert!(got.len() <= 2, "the limit of three passed: {:?}", ids(&got));
    assert_eq!(running(&mut conn), 1 + got.len() as i64);
    assert_eq!(
        ids(&got),
        waiting[3..5].to_vec(),
        "the next two nobody holds"
    );
    let mut claims: Vec<JobClaim> = first.iter().chain(&got).map(|j| j.claim()).collect();
    let (mut conn, again) = claim_beside_all(&db, conn, &waiting[..3], |c| {
        jobs::claim(c, "ql", 10, TTL).expect("the claim succeeds")
    });
    assert!(again.is_empty(), "the queue is full: {:?}", ids(&again));
    let after = jobs::claim(&mut conn, "ql", 10, TTL).unwrap();
    assert!(after.is_empty(), "the queue is full: {:?}", ids(&after));
    assert_eq!(running(&mut conn), 3, "the queue's limit");
    // One job finishes (room for one), the two at the head are held, claims of one, two and
    // three: each takes at most one, never past three running.
    for max in 1..=3usize {
        let done = claims.remove(0);
        jobs::complete(&mut conn, &[done]).unwrap();
        let head: Vec<i64> = diesel::sql_query(
            "SELECT id FROM tenure_jobs WHERE queue = 'ql' AND state = 'waiting' \
             ORDER BY priority, due_at, id LIMIT 2",
        )
        .load::<Id>(&mut conn)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
        let got;
        (conn, got) = claim_beside_all(&db, conn, &head, move |c| {
            jobs::claim(c, "ql", max, TTL).expect("the claim succeeds")
        });
        assert_eq!(got.len(), 1, "room for one, claimed {:?}", ids(&got));
        assert!(!head.contains(&got[0].id), "a held job claimed");
        assert!(running(&mut conn) <= 3, "the queue's limit of three passed");
        claims.extend(got.iter().map(|j| j.claim()));
    }
}

#[derive(QueryableByName)]
pub(super) struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct KeyState {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Integer>)]
    least: Option<i32>,
}

/// Key `key`'s running jobs and the smallest cap among them, in one statement.
pub(super) fn key_state(conn: &mut AnyConnection, key: &str) -> (i64, Option<i32>) {
    let row = diesel::sql_query(format!(
        "SELECT COUNT(*) AS n, MIN(l.max_running) AS least FROM tenure_jobs r \
         JOIN tenure_job_limits l ON l.job_id = r.id \
         WHERE r.state = 'running' AND l.limit_key = '{key}' AND l.max_running IS NOT NULL"
    ))
    .get_result::<KeyState>(conn)
    .unwrap();
    (row.n, row.least)
}

/// Several mixes of caps on one key, the first jobs in claim order held: after each claim
/// (of one, two, ten), the key's running jobs never exceed the smallest cap among them.
fn the_smallest_cap_among_a_keys_running_jobs_holds_across_rounds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mixes: [&[u32]; 6] = [
        &[3, 3, 1, 3, 3, 3],
        &[1, 3, 3, 3],
        &[3, 1, 3, 1, 3],
        &[2, 2, 2, 1, 2, 2],
        &[4, 4, 4, 1, 1, 4, 4],
        &[5, 2, 5, 5, 5, 5, 5],
    ];
    let mut checked = 0;
    for (m, caps) in mixes.iter().enumerate() {
        for held in 1..=3usize.min(caps.len() - 1) {
            for max in [1usize, 2, 10] {
                let queue = format!("cap{m}h{held}m{max}");
                let key = queue.clone();
                let all: Vec<i64> = caps
                    .iter()
                    .enumerate()
                    .map(|(i, cap)| {
                        enqueue_id(
                            &mut conn,
                            NewJob::new(queue.as_str(), "work", vec![i as u8])
                                .priority(i as i32)
                                .limit(key.as_str(), *cap),
                        )
                    })
                    .collect();
                let q = queue.clone();
                let got;
                (conn, got) = claim_beside_all(&db, conn, &all[..held], move |c| {
                    jobs::claim(c, &q, max, TTL).expect("the claim succeeds")
                });
                assert!(got.len() <= max);
                assert!(
                    got.iter().all(|j| !all[..held].contains(&j.id)),
                    "a held job was claimed"
                );
                let (n, least) = key_state(&mut conn, &key);
                assert!(
                    least.is_none_or(|least| n <= i64::from(least)),
                    "caps {caps:?}, {held} held, claim of {max}: {n} running past the smallest \
                     cap {least:?} (claimed {:?})",
                    in_order(&got)
                );
                // Let go: another claim, and the invariant again.
                let _ = jobs::claim(&mut conn, &queue, 10, TTL).unwrap();
                let (n, least) = key_state(&mut conn, &key);
                assert!(
                    least.is_none_or(|least| n <= i64::from(least)),
                    "caps {caps:?}, {held} held, claim of {max} then one of ten: {n} running \
                     past the smallest cap {least:?}"
                );
                checked += 1;
            }
        }
    }
    println!("{backend}: {checked} cap mixes checked");
}

/// A rate of two an hour (with, on the same key, a cap of three) over six jobs, the first
/// two held: a claim of ten takes two (round two), the starts are exactly those two, and no
/// claim after (held or let go) starts a third.
fn a_rate_holds_across_rounds_and_counts_only_the_jobs_claimed(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let per = Duration::from_secs(3600);
    for max in [1usize, 2, 10] {
        let queue = format!("rate{max}");
        let key = queue.clone();
        let all: Vec<i64> = (0..6u8)
            .map(|i| {
                enqueue_id(
                    &mut conn,
                    NewJob::new(queue.as_str(), "work", vec![i])
                        .priority(i32::from(i))
                        .rate_limit(key.as_str(), 2, per)
                        .limit(key.as_str(), 3),
                )
            })
            .collect();
        let starts = |conn: &mut AnyConnection| {
            count(
                conn,
                &format!("SELECT COUNT(*) AS n FROM tenure_limit_starts WHERE limit_key = '{key}'"),
            )
        };
        let mut total = Vec::new();
        for _ in 0..3 {
            let q = queue.clone();
            let got;
            (conn, got) = claim_beside_all(&db, conn, &all[..2], move |c| {
                jobs::claim(c, &q, max, TTL).expect("the claim succeeds")
            });
            total.extend(in_order(&got));
            assert_eq!(
                starts(&mut conn),
                total.len() as i64,
                "claim of {max}: starts recorded for the claimed jobs only ({total:?})"
            );
        }
        let after = jobs::claim(&mut conn, &queue, 10, TTL).unwrap();
        total.extend(in_order(&after));
        assert_eq!(starts(&mut conn), total.len() as i64, "claim of {max}");
        assert_eq!(
            total.len(),
            2,
            "claim of {max}: the rate of two an hour started {total:?}"
        );
        assert!(!total.contains(&all[0]) && !total.contains(&all[1]));
    }
}

/// Twenty held jobs at the head, five free behind. Claims of one, three and ten beside the
/// holders never fail and never return a held job or one twice (a claim of one may come back
/// empty: eight rounds pass eight); once let go, every job is claimed exactly once.
fn more_held_jobs_than_eight_rounds_pass_never_fail_a_claim(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let all: Vec<i64> = (0..25u8)
        .map(|i| {
            enqueue_id(
                &mut conn,
                NewJob::new("many", if i % 2 == 0 { "x" } else { "y" }, vec![i]),
            )
        })
        .collect();
    let held = all[..20].to_vec();
    let mut seen: HashMap<i64, usize> = HashMap::new();
    let mut sizes = Vec::new();
    for (max, kinds) in [
        (1usize, false),
        (3, false),
        (1, true),
        (3, true),
        (10, false),
    ] {
        let got;
        (conn, got) = claim_beside_all(&db, conn, &held, move |c| {
            if kinds {
                jobs::claim_kinds(c, "many", &["x", "y"], max, TTL).expect("claim of kinds")
            } else {
                jobs::claim(c, "many", max, TTL).expect("the claim succeeds")
            }
        });
        assert!(got.len() <= max);
        for j in &got {
            assert!(!held.contains(&j.id), "held job {} claimed", j.id);
            *seen.entry(j.id).or_default() += 1;
        }
        let mut sorted = in_order(&got);
        sorted.sort_unstable();
        assert_eq!(sorted, in_order(&got), "claim order (ids: one priority)");
        sizes.push((max, kinds, got.len()));
    }
    loop {
        let got = jobs::claim(&mut conn, "many", 4, TTL).unwrap();
        if got.is_empty() {
            break;
        }
        for j in &got {
            *seen.entry(j.id).or_default() += 1;
        }
    }
    println!("{backend}: claims beside twenty held jobs (max, kinds, got): {sizes:?}");
    assert!(seen.values().all(|n| *n == 1), "a job claimed twice");
    assert_eq!(seen.len(), all.len(), "nothing lost");
}

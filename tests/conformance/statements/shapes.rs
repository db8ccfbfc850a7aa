//! Prepared statements' shapes: id lists at the edges of their power-of-two shapes, a rescue of
//! a thousand claims, `jobs::list` by ids and dedup key, and names that look like SQL.

use std::collections::HashSet;
use std::time::Duration;

use tenure::jobs::{
    self, Finished, JobClaim, JobFilter, JobState, NewJob, Outcome, Retention, Retry,
};
use tenure::{AnyConnection, Backend, Error, lease};

use crate::common::{TestDb, conformance, count};

conformance!(
    id_lists_at_their_shape_edges_count_every_job_once,
    a_rescue_of_a_thousand_lapsed_claims_lists_each_once,
    names_and_values_that_look_like_sql_are_only_values,
    list_by_ids_and_dedup_key,
);

const TTL: Duration = Duration::from_secs(600);

fn claims(jobs: &[jobs::ClaimedJob]) -> Vec<JobClaim> {
    jobs.iter().map(|j| j.claim()).collect()
}

fn fill(conn: &mut AnyConnection, queue: &str, n: usize) -> Vec<i64> {
    let batch: Vec<NewJob> = (0..n)
        .map(|i| NewJob::new(queue, "k", i.to_string().into_bytes()))
        .collect();
    jobs::enqueue_many(conn, &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect()
}

fn states(conn: &mut AnyConnection, queue: &str, state: &str) -> i64 {
    count(
        conn,
        &format!(
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{queue}' AND state = '{state}'"
        ),
    )
}

/// Every shape of an id list (1, 2, 3 -> 4, 511 -> 512, 512, 513 -> 1024, 999, 1000) through
/// renew, give back, complete, and prune: one outcome per claim, exact counts, the padding
/// never acts on a job twice nor on a job outside the call.
fn id_lists_at_their_shape_edges_count_every_job_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let ids = fill(&mut conn, "edges", 1000);
    let claimed = jobs::claim(&mut conn, "edges", 1000, TTL).unwrap();
    assert_eq!(claimed.len(), 1000);
    let got: HashSet<i64> = claimed.iter().map(|j| j.id).collect();
    assert_eq!(got, ids.iter().copied().collect::<HashSet<_>>());
    let all = claims(&claimed);
    for n in [1, 2, 3, 511, 512, 513, 999, 1000] {
        assert_eq!(
            jobs::renew(&mut conn, &all[..n], TTL).unwrap(),
            vec![Outcome::Done; n],
            "renew of {n}"
        );
    }
    // Give back 3 (padded to 4 with the third): the fourth job stays running.
    assert_eq!(
        jobs::give_back(&mut conn, &all[..3]).unwrap(),
        vec![Outcome::Done; 3]
    );
    assert_eq!(states(&mut conn, "edges", "waiting"), 3);
    assert_eq!(states(&mut conn, "edges", "running"), 997);
    // A batch whose last (padding) claim is stale: Done for the live ones only.
    let mut mixed = all[3..6].to_vec();
    mixed.push(all[0]);
    assert_eq!(
        jobs::complete(&mut conn, &mixed).unwrap(),
        vec![Outcome::Done, Outcome::Done, Outcome::Done, Outcome::Lost]
    );
    assert_eq!(states(&mut conn, "edges", "completed"), 3);
    assert_eq!(
        jobs::get(&mut conn, ids_of(&all, 0))
            .unwrap()
            .unwrap()
            .state,
        JobState::Waiting
    );
    // Shapes 512 and 1024 by completion: 511 then 513 then the rest (481).
    let rest = &all[6..];
    assert_eq!(
        jobs::complete(&mut conn, &rest[..511]).unwrap(),
        vec![Outcome::Done; 511]
    );
    assert_eq!(
        jobs::complete(&mut conn, &rest[511..]).unwrap(),
        vec![Outcome::Done; 483]
    );
    assert_eq!(states(&mut conn, "edges", "completed"), 997);
    // Repeats: AlreadyDone for all 997, in one call of 997 (shape 1024).
    assert_eq!(
        jobs::complete(&mut conn, &all[3..]).unwrap(),
        vec![Outcome::AlreadyDone; 997]
    );
    // The three given back: claimed again, old claims Lost in a full batch of 1000.
    let again = jobs::claim(&mut conn, "edges", 1000, TTL).unwrap();
    assert_eq!(again.len(), 3);
    let outcomes = jobs::complete(&mut conn, &all).unwrap();
    assert_eq!(outcomes[..3], [Outcome::Lost; 3]);
    assert_eq!(outcomes[3..], vec![Outcome::AlreadyDone; 997][..]);
    // fail (a batch of 1) of one of them, with a message full of placeholders.
    let msg = "why? $1 {ids} ? '?' -- ;";
    assert_eq!(
        jobs::fail(&mut conn, again[0].claim(), msg, Retry::Never).unwrap(),
        Outcome::Done
    );
    assert_eq!(
        jobs::history(&mut conn, again[0].id)
            .unwrap()
            .last()
            .unwrap()
            .error,
        msg
    );
    assert_eq!(
        jobs::complete(&mut conn, &claims(&again[1..])).unwrap(),
        vec![Outcome::Done; 2]
    );
    assert_eq!(states(&mut conn, "edges", "completed"), 999);
    // Prune in batches of 513 / 1 / 1000: exact counts (999 completed jobs, most of them
    // finished in one statement, so a newest-N policy keeps ties: DeleteAll here).
    for (batch, want) in [(513, 513), (1, 1), (1000, 485), (1000, 0)] {
        assert_eq!(
            jobs::prune(
                &mut conn,
                "edges",
                Finished::Completed,
                Retention::DeleteAll,
                batch
            )
            .unwrap(),
            want,
            "prune batch {batch}"
        );
    }
    assert_eq!(states(&mut conn, "edges", "dead"), 1);
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        1,
        "only the dead job is left"
    );
}

fn ids_of(claims: &[JobClaim], i: usize) -> i64 {
    claims[i].id
}

/// 1000 claims lapse at once: one rescue returns each exactly once (the padded id neither
/// listed twice nor given a second history entry or lapse).
fn a_rescue_of_a_thousand_lapsed_claims_lists_each_once(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = fill(&mut conn, "lapse", 1000);
    let claimed = jobs::claim(&mut conn, "lapse", 1000, Duration::from_millis(50)).unwrap();
    assert_eq!(claimed.len(), 1000);
    std::thread::sleep(Duration::from_millis(1500));
    let rescued = jobs::rescue(&mut conn, 1000).unwrap();
    ids.sort_unstable();
    assert_eq!(rescued.requeued, ids);
    assert!(rescued.dead.is_empty() && rescued.cancelled.is_empty());
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting' AND lapses = 1 AND attempt = 0"
        ),
        1000
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_job_errors"),
        1000
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(DISTINCT job_id) AS n FROM tenure_job_errors"
        ),
        1000
    );
    assert_eq!(jobs::rescue(&mut conn, 1000).unwrap(), Default::default());
    // Then 3 (shape 4) lapse: exactly those come back.
    let three = jobs::claim(&mut conn, "lapse", 3, Duration::from_millis(50)).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let rescued = jobs::rescue(&mut conn, 1000).unwrap();
    let mut want: Vec<i64> = three.iter().map(|j| j.id).collect();
    want.sort_unstable();
    assert_eq!(rescued.requeued, want);
    assert_eq!(states(&mut conn, "lapse", "waiting"), 1000);
}

/// Queue, kind, dedup key, limit key and lease names full of placeholder syntax are values:
/// they round-trip, match only themselves, and never shift a bind.
fn names_and_values_that_look_like_sql_are_only_values(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let long = "?".repeat(255);
    let names = [
        "a?b",
        "$1",
        "{ids}",
        "it's",
        "x -- y",
        "a;b",
        "?{ids}?$2'",
        "{now}",
        "(?, ?)",
        long.as_str(),
    ];
    for name in names {
        let payload = format!("?{name}?$1").into_bytes();
        let job = NewJob::new(name, name, payload.clone())
            .dedup_key(name)
            .limit(name, 2);
        let first = jobs::enqueue(&mut conn, &job).unwrap();
        assert!(!first.existing, "{name:?}");
        let second = jobs::enqueue(&mut conn, &job).unwrap();
        assert_eq!((second.id, second.existing), (first.id, true), "{name:?}");
        let listed = jobs::list(
            &mut conn,
            &JobFilter {
                ids: Some(vec![first.id]),
                queue: Some(name.into()),
                kind: Some(name.into()),
                dedup_key: Some(name.into()),
                state: Some(JobState::Waiting),
                ..JobFilter::default()
            },
        )
        .unwrap();
        assert_eq!(listed.len(), 1, "{name:?}");
        assert_eq!(listed[0].limit_key.as_deref(), Some(name));
        jobs::pause(&mut conn, name).unwrap();
        assert!(jobs::is_paused(&mut conn, name).unwrap());
        assert!(jobs::claim(&mut conn, name, 10, TTL).unwrap().is_empty());
        jobs::resume(&mut conn, name).unwrap();
        let claimed = jobs::claim(&mut conn, name, 10, TTL).unwrap();
        assert_eq!(claimed.len(), 1, "{name:?}");
        assert_eq!(
            (
                &claimed[0].queue[..],
                &claimed[0].kind[..],
                &claimed[0].payload
            ),
            (name, name, &payload)
        );
        let msg = format!("failed: {name} ? $1");
        assert_eq!(
            jobs::fail(
                &mut conn,
                claimed[0].claim(),
                &msg,
                Retry::After(Duration::ZERO)
            )
            .unwrap(),
            Outcome::Done
        );
        assert_eq!(jobs::history(&mut conn, first.id).unwrap()[0].error, msg);
        let again = jobs::claim(&mut conn, name, 10, TTL).unwrap();
        assert_eq!(
            jobs::complete(&mut conn, &claims(&again)).unwrap(),
            [Outcome::Done]
        );
        let mut held = lease::try_take(&mut conn, name, TTL, name)
            .unwrap()
            .expect("free");
        let info = lease::inspect(&mut conn, name).unwrap().expect("taken");
        assert_eq!((&info.name[..], &info.holder[..]), (name, name));
        assert!(held.release(&mut conn).unwrap());
    }
    // Only the names themselves were touched.
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        names.len() as i64
    );
    for bad in ["a\0b", &"x".repeat(256)] {
        let err = jobs::enqueue(&mut conn, &NewJob::new(bad, "k", vec![])).unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
        let err = lease::try_take(&mut conn, bad, TTL, "h").unwrap_err();
        assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
    }
}

/// `jobs::list` by ids: duplicates and unknown ids are harmless, 1000 ids work, 1001 are
/// refused, none gives none; the id filter combines with the others.
fn list_by_ids_and_dedup_key(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue(&mut conn, &NewJob::new("la", "k1", vec![]).dedup_key("d1"))
        .unwrap()
        .id;
    let b = jobs::enqueue(&mut conn, &NewJob::new("la", "k2", vec![]).dedup_key("d2"))
        .unwrap()
        .id;
    let c = jobs::enqueue(&mut conn, &NewJob::new("lb", "k1", vec![]).dedup_key("d1"))
        .unwrap()
        .id;
    let list = |conn: &mut AnyConnection, filter: JobFilter| -> Vec<i64> {
        jobs::list(conn, &filter)
            .unwrap()
            .into_iter()
            .map(|j| j.id)
            .collect()
    };
    let by_ids = |ids: Vec<i64>| JobFilter {
        ids: Some(ids),
        ..JobFilter::default()
    };
    assert_eq!(list(&mut conn, by_ids(vec![a, a, a])), vec![a]);
    assert_eq!(
        list(&mut conn, by_ids(vec![-1, 0, a, i64::MIN, i64::MAX, c, a])),
        vec![c, a]
    );
    let mut many: Vec<i64> = (1_000_000..1_000_997).collect();
    many.extend([a, b, c]);
    assert_eq!(list(&mut conn, by_ids(many.clone())), vec![c, b, a]);
    many.push(b);
    let err = jobs::list(&mut conn, &by_ids(many)).unwrap_err();
    assert!(matches!(err, Error::InvalidInput { .. }), "{err}");
    assert!(list(&mut conn, by_ids(vec![])).is_empty());
    // Combined.
    let f = JobFilter {
        ids: Some(vec![a, b, c]),
        dedup_key: Some("d1".into()),
        ..JobFilter::default()
    };
    assert_eq!(list(&mut conn, f.clone()), vec![c, a]);
    assert_eq!(
        list(
            &mut conn,
            JobFilter {
                queue: Some("la".into()),
                ..f.clone()
            }
        ),
        vec![a]
    );
    assert_eq!(
        list(
            &mut conn,
            JobFilter {
                kind: Some("k2".into()),
                ..f.clone()
            }
        ),
        Vec::<i64>::new()
    );
    assert_eq!(
        list(
            &mut conn,
            JobFilter {
                limit: 1,
                ..f.clone()
            }
        ),
        vec![c]
    );
    assert_eq!(
        list(
            &mut conn,
            JobFilter {
                state: Some(JobState::Running),
                ..f
            }
        ),
        Vec::<i64>::new()
    );
    // Every id count from 1 to 40 (each a new text on the backends without arrays).
    for n in 1..=40 {
        let mut ids: Vec<i64> = (0..n).map(|i| 5_000_000 + i).collect();
        ids[0] = b;
        assert_eq!(list(&mut conn, by_ids(ids)), vec![b], "{n} ids");
    }
}

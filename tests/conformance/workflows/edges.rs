//! Workflows at the edges of size and shape: odd dependency lists, a fan-in of 2000, a
//! workflow of 100 independent steps.

use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob, Outcome};
use tenure::{Backend, Error};

use crate::common::{
    TestDb, claim_one, conformance, count, enqueue_id as enqueue, job_state as state,
};

conformance!(
    a_fan_in_of_2000_completed_in_batches_of_50_in_mixed_orders_by_8_threads,
    odd_dependency_lists_are_refused_or_normalised,
    a_workflow_of_100_independent_steps_is_whole,
);

const TTL: Duration = Duration::from_secs(120);

/// One job depends on 2,000 (the stripes cap); 8 threads claim 50 at a time and complete
/// each batch in one call, listing the claims reversed or rotated: no error, and the
/// dependent is released exactly once, after the last.
fn a_fan_in_of_2000_completed_in_batches_of_50_in_mixed_orders_by_8_threads(backend: Backend) {
    const N: usize = 2000;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for chunk in 0..N / 500 {
        let batch: Vec<NewJob> = (0..500)
            .map(|i| NewJob::json("f", "part", &(chunk * 500 + i)).unwrap())
            .collect();
        ids.extend(
            jobs::enqueue_many(&mut conn, &batch)
                .unwrap()
                .iter()
                .map(|e| e.id),
        );
    }
    let join = enqueue(&mut conn, NewJob::new("j", "join", vec![]).depends_on(ids));
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_dependency_stripes WHERE job_id = {join}")
        ),
        // The stripes a job's dependencies are spread over are at most eight (a tuning
        // bound inside the crate, `dependencies::MAX_STRIPES`).
        8
    );
    let errors = crate::common::race(&db, 8, move |t, c| {
        let mut errors = Vec::new();
        let mut round = 0usize;
        loop {
            let claimed = match jobs::claim(c, "f", 50, TTL) {
                Ok(claimed) if claimed.is_empty() => return errors,
                Ok(claimed) => claimed,
                Err(e) => {
                    errors.push(format!("claim: {e}"));
                    continue;
                }
            };
            let mut claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
            round += 1;
            if (t + round) % 2 == 0 {
                claims.reverse();
            } else {
                let k = (t * 7 + round) % claims.len();
                claims.rotate_left(k);
            }
            match jobs::complete(c, &claims) {
                Ok(o) if o.iter().all(|o| *o == Outcome::Done) => {}
                Ok(o) => errors.push(format!("outcomes {o:?}")),
                Err(e) => errors.push(format!("complete: {e}")),
            }
        }
    });
    let errors: Vec<String> = errors.into_iter().flatten().collect();
    assert!(
        errors.is_empty(),
        "{} errors: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert_eq!(state(&mut conn, join), JobState::Waiting);
    assert_eq!(jobs::claim(&mut conn, "j", 10, TTL).unwrap().len(), 1);
}

/// Negative and missing ids are refused and write nothing; repeats count once (the
/// dependent is released by the one completion).
fn odd_dependency_lists_are_refused_or_normalised(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    for bad in [vec![-1], vec![a, i64::MAX], vec![0, a], vec![i64::MIN, a]] {
        let r = jobs::enqueue(
            &mut conn,
            &NewJob::new("q", "x", vec![]).depends_on(bad.clone()),
        );
        assert!(
            matches!(r, Err(Error::InvalidInput { .. })),
            "{bad:?}: {r:?}"
        );
    }
    let many = NewJob::new("q", "x", vec![]).depends_on(vec![a; 5000]);
    assert!(
        jobs::enqueue_many(
            &mut conn,
            &[many.clone(), NewJob::new("q", "y", vec![]), many]
        )
        .is_ok()
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_job_dependencies"
        ),
        2
    );
    let job = claim_one(&mut conn, "q", "a");
    jobs::complete(&mut conn, &[job.claim()]).unwrap();
    assert_eq!(
        jobs::claim_kinds(&mut conn, "q", &["x"], 10, TTL)
            .unwrap()
            .len(),
        2
    );
}

/// A workflow's first run of 100 steps without dependencies (copied on PostgreSQL): every
/// step is the workflow's, and its callback runs once they all completed.
fn a_workflow_of_100_independent_steps_is_whole(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut flow = jobs::Workflow::new("wide");
    for i in 0..100u32 {
        flow.add(NewJob::new("w", "step", i.to_be_bytes().to_vec()).limit("wl", 100));
    }
    flow.on_success(NewJob::new("w", "done", vec![]));
    let made = jobs::enqueue_workflow(&mut conn, &flow).unwrap();
    assert_eq!(made.jobs.len(), 100);
    for (i, id) in made.jobs.iter().enumerate() {
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        assert_eq!(job.workflow_id, Some(made.id), "step {i}");
        assert_eq!(job.payload, (i as u32).to_be_bytes(), "step {i}");
    }
    let status = jobs::workflow_status(&mut conn, made.id).unwrap().unwrap();
    assert_eq!((status.counts.waiting, status.counts.blocked), (100, 0));
    let claimed = jobs::claim(&mut conn, "w", 1000, Duration::from_secs(60)).unwrap();
    assert_eq!(claimed.len(), 100);
    let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
    jobs::complete(&mut conn, &claims).unwrap();
    let done = jobs::get(&mut conn, made.on_success.unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(done.state, jobs::JobState::Waiting);
}

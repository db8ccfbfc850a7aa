//! Races of a workflow's dependents on Galera (issue 37): an enqueue of dependents racing the
//! completion of their dependencies on another node; dependencies failed, cancelled and
//! completed on three nodes at once. Every call is repeated while it answers a retryable
//! error (as a worker does); what each call finally answered must agree with the rows
//! afterwards, on every node.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob, Outcome, Retry, RunWhen};

use super::galera::ClusterDb;
use super::galera_across_nodes::{claim_retrying, complete_retrying, count, settle};
use super::galera_races::*;

/// Jobs claimed on node 1; node 2 enqueues dependents of them (three per job, one call each,
/// spread over the jobs) while node 3 completes them, 20 rounds of 12. The promise: every
/// dependent an enqueue acknowledged exists once, no other dependent exists (an enqueue
/// repeated after an abort must not leave its first attempt behind), and each is released
/// (waiting) once its dependency completed.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_dependents_enqueued_while_their_dependencies_complete_on_another_node_are_released() {
    const ROUNDS: usize = 20;
    const N: usize = 12;
    let db = ClusterDb::new();
    let mut conns = connect_all(&db);
    // The racing sides go through pools, as workers and web apps do (see `complete_pooled`).
    let (pool2, pool3) = (db.pool(1), db.pool(2));
    let before = aborts(&mut conns);
    let mut total = 0i64;
    let mut broken = Vec::new();
    for round in 0..ROUNDS {
        let queue = format!("e{round}");
        let dq = format!("{queue}d");
        let ids: Vec<i64> = enqueue_plain(&mut conns[0], &queue, N);
        total += N as i64;
        let mut claimed = claim_retrying(&mut conns[0], &queue, N);
        claimed.sort_by_key(|j| j.id);
        settle(&db, total);
        std::thread::sleep(Duration::from_millis(100));
        let barrier = Arc::new(Barrier::new(2));
        let (enqueued, completes) = {
            let pool2 = &pool2;
            std::thread::scope(|s| {
                let b = barrier.clone();
                let ids = &ids;
                let dq = &dq;
                let enqueuer = s.spawn(move || {
                    let mut out = Vec::new();
                    for (i, id) in ids.iter().enumerate() {
                        barrier_then_jitter(&b, 1500);
                        for k in 0..3 {
                            // Some depend on two jobs, one of them the next.
                            let mut deps = vec![*id];
                            if k == 1 {
                                deps.push(ids[(i + 1) % ids.len()]);
                            }
                            let job = NewJob::new(dq.as_str(), "d", vec![]).depends_on(deps);
                            out.push(
                                retrying("enqueue", || jobs::enqueue(&mut pool2.get()?, &job)).id,
                            );
                        }
                    }
                    out
                });
                let b = barrier.clone();
                let claimed = &claimed;
                let pool3 = &pool3;
                let completer = s.spawn(move || {
                    claimed
                        .iter()
                        .map(|j| {
                            lockstep(&b);
                            complete_pooled(pool3, j.claim())
                        })
                        .collect::<Vec<_>>()
                });
                (enqueuer.join().unwrap(), completer.join().unwrap())
            })
        };
        total += enqueued.len() as i64;
        assert!(
            completes.iter().all(|o| *o == Outcome::Done),
            "{completes:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
        let in_db = count(
            &mut conns[0],
            &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = '{dq}'"),
        );
        if in_db != enqueued.len() as i64 {
            broken.push(format!(
                "round {round}: {} dependents acknowledged, {in_db} in the table",
                enqueued.len()
            ));
            total = total - enqueued.len() as i64 + in_db;
        }
        for id in &enqueued {
            let job = agreed(&mut conns, *id);
            if job.state != JobState::Waiting {
                broken.push(format!(
                    "round {round} dependent {id}: {:?} (its dependencies all completed)",
                    job.state
                ));
            }
        }
        let total_db = jobs_in(&mut conns[0]);
        if total_db != total {
            broken.push(format!("round {round}: {total_db} jobs, {total} expected"));
            total = total_db;
        }
    }
    conclude(
        &before,
        &mut conns,
        &broken,
        "dependents enqueued while their dependencies completed",
    );
}

/// Dependents of three jobs each: the first failed for good (dead) on node 1, the second
/// cancelled (waiting: at once) on node 2, the third completed on node 3, at the same
/// instant, 20 rounds of 10 triples. Each triple has three dependents, one per `RunWhen`:
/// all completed (cancelled, once), all finished (released once every one ended), any
/// failed (released). Every pending count ends at zero or the dependent is cancelled.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_dependencies_failed_cancelled_and_completed_on_three_nodes_settle_dependents_once() {
    const ROUNDS: usize = 20;
    const N: usize = 10;
    let db = ClusterDb::new();
    let mut conns = connect_all(&db);
    let before = aborts(&mut conns);
    let mut total = 0i64;
    let mut broken = Vec::new();
    for round in 0..ROUNDS {
        let qa = format!("a{round}");
        let qc = format!("c{round}");
        let qw = format!("w{round}");
        let qd = format!("d{round}");
        let mut triples = Vec::new();
        for _ in 0..N {
            let a = jobs::enqueue(&mut conns[0], &NewJob::new(qa.as_str(), "a", vec![]))
                .unwrap()
                .id;
            let w = jobs::enqueue(&mut conns[0], &NewJob::new(qw.as_str(), "w", vec![]))
                .unwrap()
                .id;
            let c = jobs::enqueue(&mut conns[0], &NewJob::new(qc.as_str(), "c", vec![]))
                .unwrap()
                .id;
            let deps = [a, w, c];
            let dependents: Vec<i64> = [
                RunWhen::AllCompleted,
                RunWhen::AllFinished,
                RunWhen::AnyFailed,
            ]
            .iter()
            .map(|rw| {
                jobs::enqueue(
                    &mut conns[0],
                    &NewJob::new(qd.as_str(), "d", vec![])
                        .depends_on(deps)
                        .run_when(*rw),
                )
                .unwrap()
                .id
            })
            .collect();
            triples.push((a, w, c, dependents));
        }
        total += 6 * N as i64;
        let mut to_fail = claim_retrying(&mut conns[0], &qa, N);
        to_fail.sort_by_key(|j| j.id);
        let mut to_complete = claim_retrying(&mut conns[0], &qc, N);
        to_complete.sort_by_key(|j| j.id);
        settle(&db, total);
        std::thread::sleep(Duration::from_millis(100));
        let barrier = Arc::new(Barrier::new(3));
        let (fails, cancels, completes) = {
            let (c1, rest) = conns.split_at_mut(1);
            let (c2, c3) = rest.split_at_mut(1);
            let (c1, c2, c3) = (&mut c1[0], &mut c2[0], &mut c3[0]);
            std::thread::scope(|s| {
                let b = barrier.clone();
                let to_fail = &to_fail;
                let failer = s.spawn(move || {
                    b.wait();
                    to_fail
                        .iter()
                        .map(|j| fail_retrying(c1, j.claim(), Retry::Never))
                        .collect::<Vec<_>>()
                });
                let b = barrier.clone();
                let triples = &triples;
                let canceller = s.spawn(move || {
                    b.wait();
                    triples
                        .iter()
                        .map(|t| cancel_retrying(c2, t.1))
                        .collect::<Vec<_>>()
                });
                let b = barrier.clone();
                let to_complete = &to_complete;
                let completer = s.spawn(move || {
                    b.wait();
                    to_complete
                        .iter()
                        .map(|j| complete_retrying(c3, &[j.claim()])[0])
                        .collect::<Vec<_>>()
                });
                (
                    failer.join().unwrap(),
                    canceller.join().unwrap(),
                    completer.join().unwrap(),
                )
            })
        };
        assert!(fails.iter().all(|o| *o == Outcome::Done), "{fails:?}");
        assert!(cancels.iter().all(|c| *c), "{cancels:?}");
        assert!(
            completes.iter().all(|o| *o == Outcome::Done),
            "{completes:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
        for (a, w, c, dependents) in &triples {
            let states: Vec<JobState> = [*a, *w, *c]
                .iter()
                .map(|id| agreed(&mut conns, *id).state)
                .collect();
            let got: Vec<JobState> = dependents
                .iter()
                .map(|id| agreed(&mut conns, *id).state)
                .collect();
            let want = vec![JobState::Cancelled, JobState::Waiting, JobState::Waiting];
            let pending: Vec<i64> = dependents
                .iter()
                .map(|id| {
                    count(
                        &mut conns[0],
                        &format!(
                            "SELECT CAST(COALESCE(SUM(pending), 0) AS SIGNED) AS n \
                             FROM tenure_dependency_stripes WHERE job_id = {id}"
                        ),
                    )
                })
                .collect();
            let uncounted = count(
                &mut conns[0],
                &format!(
                    "SELECT COUNT(*) AS n FROM tenure_job_dependencies \
                     WHERE depends_on IN ({a}, {w}, {c}) AND counted = 0"
                ),
            );
            if states != [JobState::Dead, JobState::Cancelled, JobState::Completed]
                || got != want
                || uncounted != 0
                || pending[1] != 0
            {
                broken.push(format!(
                    "round {round} deps {a},{w},{c} {states:?}: dependents {dependents:?} \
                     {got:?} (want {want:?}), stripes pending {pending:?}, edges uncounted \
                     {uncounted}"
                ));
            }
        }
        // Released exactly once: the released dependents are claimable once each.
        let released = claim_retrying(&mut conns[0], &qd, 1000);
        if released.len() != 2 * N {
            broken.push(format!(
                "round {round}: {} dependents claimable, {} expected",
                released.len(),
                2 * N
            ));
        }
    }
    conclude(&before, &mut conns, &broken, "dependents settled wrongly");
}

/// Completes `claim` through a pool, as a worker does, a new checkout for each try. This race
/// is the one that met a Galera abort reported as a trigger's error ("Trigger
/// 'tenure_ready_inserted' has an error in its body"), after which the node failed every
/// statement firing `tenure_jobs`' triggers, on every connection, until the table was flushed
/// (without tenure's flush: 500 refusals in a row, in run 1 of 1; with it 8 of 8 passed).
fn complete_pooled(pool: &tenure::Pool, claim: jobs::JobClaim) -> Outcome {
    retrying(&format!("complete {}", claim.id), || {
        let mut conn = pool.get()?;
        jobs::complete(&mut conn, &[claim]).map(|outcomes| outcomes[0])
    })
}

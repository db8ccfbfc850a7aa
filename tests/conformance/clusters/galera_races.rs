//! Races on Galera (issue 37) over operations that carry no per-statement guard of their own
//! (the question before each commit covers them): a fail (retry or dead) racing a cancel on
//! another node, a completion racing a cancel, a rescue of lapsed claims racing their
//! completion, a lease renewed at its expiry while the other nodes take it. The races of
//! dependents are in `galera_race_dependents`.
//! Every call is repeated while it answers a retryable error (as a worker does); what each
//! call finally answered must agree with the rows afterwards, on every node.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tenure::AnyConnection;
use tenure::jobs::{self, JobState, NewJob, Outcome, Retry};

use super::galera::ClusterDb;
use super::galera_across_nodes::{claim_retrying, complete_retrying, count, settle};

/// Both sides of a race meet before each job, then one waits 0-4 ms (so that the other
/// node's commit lands anywhere inside the transaction it races).
pub(super) fn lockstep(barrier: &Barrier) {
    barrier_then_jitter(barrier, 4000);
}

pub(super) fn barrier_then_jitter(barrier: &Barrier, max_micros: u64) {
    barrier.wait();
    std::thread::sleep(Duration::from_micros(rand_micros(max_micros)));
}

pub(super) fn rand_micros(max: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish() % max
}

/// Longer than this, a call is a client left waiting (promise 2).
pub(super) const SLOW: Duration = Duration::from_secs(20);

/// The retryable refusals the calls met, by the first words of their message (to see that
/// the races conflict at all).
static REFUSALS: std::sync::Mutex<BTreeMap<String, usize>> = std::sync::Mutex::new(BTreeMap::new());

pub(super) fn report_refusals() {
    eprintln!("retryable refusals met: {:?}", REFUSALS.lock().unwrap());
}

/// Per node, the brute-force aborts and certification failures it counted so far (cluster
/// wide status, so only the difference over a test means anything).
pub(super) fn aborts(conns: &mut [AnyConnection]) -> Vec<(i64, i64)> {
    let status = |c: &mut AnyConnection, name: &str| {
        count(
            c,
            &format!(
                "SELECT CAST(VARIABLE_VALUE AS SIGNED) AS n FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME = '{name}'"
            ),
        )
    };
    conns
        .iter_mut()
        .map(|c| {
            (
                status(c, "WSREP_LOCAL_BF_ABORTS"),
                status(c, "WSREP_LOCAL_CERT_FAILURES"),
            )
        })
        .collect()
}

pub(super) fn report_aborts(before: &[(i64, i64)], conns: &mut [AnyConnection]) {
    let after = aborts(conns);
    let delta: Vec<(i64, i64)> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a.0 - b.0, a.1 - b.1))
        .collect();
    eprintln!("per node (brute-force aborts, certification failures) during the test: {delta:?}");
}

pub(super) fn retrying<T>(what: &str, mut call: impl FnMut() -> tenure::Result<T>) -> T {
    let started = Instant::now();
    let mut last = String::new();
    for _ in 0..500 {
        match call() {
            Ok(v) => {
                assert!(
                    started.elapsed() < SLOW,
                    "{what} took {:?} (last refusal: {last})",
                    started.elapsed()
                );
                return v;
            }
            Err(e) if e.is_retryable() => {
                last = e.to_string();
                let kind: String = last.chars().take(60).collect();
                *REFUSALS.lock().unwrap().entry(kind).or_insert(0) += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("{what}: {e} ({e:?}) after {:?}", started.elapsed()),
        }
    }
    panic!("{what}: refused 500 times in a row, last: {last}")
}

pub(super) fn cancel_retrying(conn: &mut AnyConnection, id: i64) -> bool {
    retrying(&format!("cancel {id}"), || jobs::cancel(conn, id))
}

pub(super) fn fail_retrying(
    conn: &mut AnyConnection,
    claim: jobs::JobClaim,
    retry: Retry,
) -> Outcome {
    retrying(&format!("fail {}", claim.id), || {
        jobs::fail(conn, claim, "boom", retry)
    })
}

pub(super) fn errors_of(conn: &mut AnyConnection, id: i64) -> i64 {
    count(
        conn,
        &format!("SELECT COUNT(*) AS n FROM tenure_job_errors WHERE job_id = {id}"),
    )
}

/// A job's row as every node has it, once they agree (Galera applies others' commits
/// asynchronously).
pub(super) fn agreed(conns: &mut [AnyConnection], id: i64) -> jobs::Job {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows: Vec<jobs::Job> = conns
            .iter_mut()
            .map(|c| jobs::get(c, id).unwrap().expect("the job"))
            .collect();
        let key = |j: &jobs::Job| {
            (
                j.state,
                j.attempt,
                j.cancel_requested_at.is_some(),
                j.finished_at,
                j.last_error.clone(),
            )
        };
        if rows.iter().all(|r| key(r) == key(&rows[0])) || Instant::now() > deadline {
            return rows.into_iter().next().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `n` jobs of kind "j" enqueued in `queue` on `conn`, their ids in order.
pub(super) fn enqueue_plain(conn: &mut AnyConnection, queue: &str, n: usize) -> Vec<i64> {
    (0..n)
        .map(|_| {
            jobs::enqueue(conn, &NewJob::new(queue, "j", vec![]))
                .unwrap()
                .id
        })
        .collect()
}

/// The end of a race: what it met, then no outcome that disagrees with the rows.
pub(super) fn conclude(
    before: &[(i64, i64)],
    conns: &mut [AnyConnection],
    broken: &[String],
    what: &str,
) {
    report_refusals();
    report_aborts(before, conns);
    assert!(
        broken.is_empty(),
        "{what} ({}):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

pub(super) fn connect_all(db: &ClusterDb) -> Vec<AnyConnection> {
    db.urls
        .iter()
        .map(|u| AnyConnection::connect(u).expect("a node"))
        .collect()
}

pub(super) fn jobs_in(conn: &mut AnyConnection) -> i64 {
    count(conn, "SELECT COUNT(*) AS n FROM tenure_jobs")
}

/// Jobs claimed on node 1, each with one dependent (all completed, the default); node 2
/// cancels each while node 3 fails each (a retry in an hour in even rounds, dead in odd
/// ones), in the same order, at the same instant, 20 rounds of 20. The promise: a cancel that
/// answered true leaves the job cancelled; a fail that answered Done left it waiting (retry)
/// or dead, with its error recorded once; Cancelled: cancelled, no error recorded; and the
/// dependent is cancelled exactly when its dependency did not complete (always, here).
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_fail_racing_a_cancel_on_another_node_ends_each_job_once() {
    const ROUNDS: usize = 20;
    const N: usize = 20;
    let db = ClusterDb::new();
    let mut conns = connect_all(&db);
    let before = aborts(&mut conns);
    let mut total = 0i64;
    let mut broken = Vec::new();
    for round in 0..ROUNDS {
        let queue = format!("f{round}");
        let dead = round % 2 == 1;
        let ids: Vec<i64> = enqueue_plain(&mut conns[0], &queue, N);
        let dependents: Vec<i64> = ids
            .iter()
            .map(|id| {
                jobs::enqueue(
                    &mut conns[0],
                    &NewJob::new(format!("{queue}d").as_str(), "d", vec![]).depends_on([*id]),
                )
                .unwrap()
                .id
            })
            .collect();
        total += 2 * N as i64;
        let mut claimed = claim_retrying(&mut conns[0], &queue, N);
        claimed.sort_by_key(|j| j.id);
        assert_eq!(claimed.len(), N);
        settle(&db, total);
        std::thread::sleep(Duration::from_millis(100));
        let barrier = Arc::new(Barrier::new(2));
        let retry = if dead {
            Retry::Never
        } else {
            Retry::After(Duration::from_secs(3600))
        };
        let (cancels, fails) = {
            let (a, rest) = conns.split_at_mut(2);
            let (c2, c3) = (&mut a[1], &mut rest[0]);
            std::thread::scope(|s| {
                let b = barrier.clone();
                let ids = &ids;
                let canceller = s.spawn(move || {
                    ids.iter()
                        .map(|id| {
                            lockstep(&b);
                            cancel_retrying(c2, *id)
                        })
                        .collect::<Vec<_>>()
                });
                let b = barrier.clone();
                let claimed = &claimed;
                let failer = s.spawn(move || {
                    claimed
                        .iter()
                        .map(|j| {
                            lockstep(&b);
                            fail_retrying(c3, j.claim(), retry)
                        })
                        .collect::<Vec<_>>()
                });
                (canceller.join().unwrap(), failer.join().unwrap())
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        for i in 0..N {
            let id = ids[i];
            let job = agreed(&mut conns, id);
            let dependent = agreed(&mut conns, dependents[i]);
            let errors = errors_of(&mut conns[0], id);
            let (cancel, fail) = (cancels[i], fails[i]);
            let fine = match fail {
                Outcome::Done | Outcome::AlreadyDone => {
                    // The fail came first: the job waited for its retry (then the cancel
                    // cancelled it: true), or died (the cancel found it dead: false).
                    errors == 1
                        && if dead {
                            !cancel && job.state == JobState::Dead
                        } else {
                            cancel && job.state == JobState::Cancelled
                        }
                }
                Outcome::Cancelled => cancel && job.state == JobState::Cancelled && errors == 0,
                Outcome::Lost => false,
            } && dependent.state == JobState::Cancelled
                && job.cancel_requested_at.is_some() == (fail == Outcome::Cancelled);
            if !fine {
                broken.push(format!(
                    "round {round} ({}) job {id}: cancel -> {cancel}, fail -> {fail:?}; row: {:?} \
                     attempt {} cancel_requested {} errors {errors} last_error {:?}; dependent {}: {:?}",
                    if dead { "dead" } else { "retry" },
                    job.state,
                    job.attempt,
                    job.cancel_requested_at.is_some(),
                    job.last_error,
                    dependent.id,
                    dependent.state,
                ));
            }
        }
    }
    conclude(
        &before,
        &mut conns,
        &broken,
        "outcomes that disagree with the rows",
    );
}

/// Jobs claimed on node 1, each with one dependent; node 2 cancels each while node 3
/// completes each, 20 rounds of 20. The promise: exactly one of them wins per job: complete
/// Done, cancel false, the job completed and its dependent released (waiting); or complete
/// Cancelled, cancel true, the job and its dependent cancelled.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_completion_racing_a_cancel_on_another_node_ends_each_job_once() {
    const ROUNDS: usize = 20;
    const N: usize = 20;
    let db = ClusterDb::new();
    let mut conns = connect_all(&db);
    let before = aborts(&mut conns);
    let mut total = 0i64;
    let mut broken = Vec::new();
    let mut tally = BTreeMap::new();
    for round in 0..ROUNDS {
        let queue = format!("c{round}");
        let ids: Vec<i64> = enqueue_plain(&mut conns[0], &queue, N);
        let dependents: Vec<i64> = ids
            .iter()
            .map(|id| {
                jobs::enqueue(
                    &mut conns[0],
                    &NewJob::new(format!("{queue}d").as_str(), "d", vec![]).depends_on([*id]),
                )
                .unwrap()
                .id
            })
            .collect();
        total += 2 * N as i64;
        let mut claimed = claim_retrying(&mut conns[0], &queue, N);
        claimed.sort_by_key(|j| j.id);
        assert_eq!(claimed.len(), N);
        settle(&db, total);
        std::thread::sleep(Duration::from_millis(100));
        let barrier = Arc::new(Barrier::new(2));
        let (cancels, completes) = {
            let (a, rest) = conns.split_at_mut(2);
            let (c2, c3) = (&mut a[1], &mut rest[0]);
            std::thread::scope(|s| {
                let b = barrier.clone();
                let ids = &ids;
                let canceller = s.spawn(move || {
                    ids.iter()
                        .map(|id| {
                            lockstep(&b);
                            cancel_retrying(c2, *id)
                        })
                        .collect::<Vec<_>>()
                });
                let b = barrier.clone();
                let claimed = &claimed;
                let completer = s.spawn(move || {
                    claimed
                        .iter()
                        .map(|j| {
                            lockstep(&b);
                            complete_retrying(c3, &[j.claim()])[0]
                        })
                        .collect::<Vec<_>>()
                });
                (canceller.join().unwrap(), completer.join().unwrap())
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        for i in 0..N {
            let id = ids[i];
            let job = agreed(&mut conns, id);
            let dependent = agreed(&mut conns, dependents[i]);
            let (cancel, complete) = (cancels[i], completes[i]);
            *tally.entry(format!("{complete:?}/{cancel}")).or_insert(0) += 1;
            let fine = match complete {
                Outcome::Done | Outcome::AlreadyDone => {
                    !cancel
                        && job.state == JobState::Completed
                        && dependent.state == JobState::Waiting
                }
                Outcome::Cancelled => {
                    cancel
                        && job.state == JobState::Cancelled
                        && dependent.state == JobState::Cancelled
                }
                Outcome::Lost => false,
            };
            if !fine {
                broken.push(format!(
                    "round {round} job {id}: cancel -> {cancel}, complete -> {complete:?}; row: {:?} \
                     cancel_requested {}; dependent {}: {:?}",
                    job.state,
                    job.cancel_requested_at.is_some(),
                    dependent.id,
                    dependent.state,
                ));
            }
        }
    }
    eprintln!("complete/cancel outcomes: {tally:?}");
    conclude(
        &before,
        &mut conns,
        &broken,
        "outcomes that disagree with the rows",
    );
}

/// Jobs claimed on node 1 with a 1 s claim, left to lapse; then node 2 completes each (a
/// lapsed claim not yet rescued still completes) while node 3 rescues, 15 rounds of 20.
/// The promise: a job is completed (complete Done, never rescued) or rescued (complete
/// Lost, waiting again), never both, and every rescued job is waiting.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_rescue_racing_completions_on_another_node_never_requeues_a_completed_job() {
    const ROUNDS: usize = 15;
    const N: usize = 20;
    let db = ClusterDb::new();
    let mut conns = connect_all(&db);
    let before = aborts(&mut conns);
    let mut total = 0i64;
    let mut broken = Vec::new();
    let mut tally = BTreeMap::new();
    for round in 0..ROUNDS {
        let queue = format!("r{round}");
        let ids: Vec<i64> = enqueue_plain(&mut conns[0], &queue, N);
        total += N as i64;
        let claimed = retrying("claim", || {
            jobs::claim(&mut conns[0], &queue, N, Duration::from_secs(1))
        });
        assert_eq!(claimed.len(), N);
        settle(&db, total);
        std::thread::sleep(Duration::from_millis(1300));
        let barrier = Arc::new(Barrier::new(2));
        let (rescued, completes) = {
            let (a, rest) = conns.split_at_mut(2);
            let (c2, c3) = (&mut a[1], &mut rest[0]);
            std::thread::scope(|s| {
                let b = barrier.clone();
                let claimed = &claimed;
                let completer = s.spawn(move || {
                    b.wait();
                    claimed
                        .iter()
                        .map(|j| (j.id, complete_retrying(c2, &[j.claim()])[0]))
                        .collect::<BTreeMap<_, _>>()
                });
                let b = barrier.clone();
                let rescuer = s.spawn(move || {
                    b.wait();
                    let mut all = Vec::new();
                    // A few passes, one job at a time: many small transactions racing.
                    for _ in 0..N * 2 {
                        let r = retrying("rescue", || jobs::rescue(c3, 1));
                        all.extend(r.requeued);
                        all.extend(r.dead);
                        all.extend(r.cancelled);
                    }
                    all
                });
                (rescuer.join().unwrap(), completer.join().unwrap())
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        for id in &ids {
            let job = agreed(&mut conns, *id);
            let complete = completes[id];
            let times = rescued.iter().filter(|r| *r == id).count();
            *tally
                .entry(format!("{complete:?}/rescued {times}"))
                .or_insert(0) += 1;
            let fine = match complete {
                Outcome::Done => times == 0 && job.state == JobState::Completed,
                Outcome::Lost => times == 1 && job.state == JobState::Waiting,
                _ => false,
            };
            if !fine {
                broken.push(format!(
                    "round {round} job {id}: complete -> {complete:?}, rescued {times} times; \
                     row: {:?} attempt {} lapses {} last_error {:?}",
                    job.state, job.attempt, job.lapses, job.last_error
                ));
            }
        }
    }
    eprintln!("complete/rescue outcomes: {tally:?}");
    conclude(
        &before,
        &mut conns,
        &broken,
        "outcomes that disagree with the rows",
    );
}

/// A lease of 200 ms contended by one thread per node for 15 s: a holder renews it just
/// before (or just after) it lapses, the others try to take it every 2 ms. The promise: the
/// holdings, ordered by grant, never overlap (a grant never comes before the previous
/// holding's last acknowledged expiry) and fences strictly increase. A renewal that failed is
/// taken as not applied, so a failed renewal that committed shows as an overlap too.
#[test]
#[ignore = "needs a Galera cluster: scripts/test-clusters"]
fn galera_a_lease_renewed_at_its_expiry_while_other_nodes_take_it_has_one_holder() {
    let db = ClusterDb::new();
    let mut conns = connect_all(&db);
    let before = aborts(&mut conns);
    let ttl = Duration::from_millis(200);
    let until = Instant::now() + Duration::from_secs(15);
    let holdings: Vec<Holding> = std::thread::scope(|s| {
        let threads: Vec<_> = conns
            .iter_mut()
            .enumerate()
            .map(|(node, c)| {
                s.spawn(move || {
                    let mut mine = Vec::new();
                    while Instant::now() < until {
                        let got = match tenure::lease::try_take(c, "race", ttl, &format!("n{node}"))
                        {
                            Ok(got) => got,
                            Err(e) if e.is_retryable() => None,
                            Err(e) => panic!("take on node {}: {e}", node + 1),
                        };
                        let Some(mut lease) = got else {
                            std::thread::sleep(Duration::from_millis(2));
                            continue;
                        };
                        let mut held = Holding {
                            node: node + 1,
                            fence: lease.fence(),
                            acquired: lease.acquired_at(),
                            expires: lease.expires_at(),
                        };
                        // Renew a few times, around the expiry: 0-40 ms before it, or up
                        // to 10 ms after.
                        for _ in 0..3 {
                            let left = (held.expires - chrono::Utc::now())
                                .to_std()
                                .unwrap_or_default();
                            let aim = left.as_micros() as i64 - rand_micros(40_000) as i64 + 10_000;
                            std::thread::sleep(Duration::from_micros(aim.max(0) as u64));
                            match lease.renew(c, ttl) {
                                Ok(()) => held.expires = lease.expires_at(),
                                Err(_) => break,
                            }
                        }
                        mine.push(held);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    mine
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    let mut holdings = holdings;
    holdings.sort_by_key(|h| (h.acquired, h.fence));
    let mut broken = Vec::new();
    for pair in holdings.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.acquired < a.expires || b.fence <= a.fence {
            broken.push(format!("{a:?} then {b:?}"));
        }
    }
    let nodes: BTreeMap<usize, usize> = holdings.iter().fold(BTreeMap::new(), |mut m, h| {
        *m.entry(h.node).or_insert(0) += 1;
        m
    });
    eprintln!("{} holdings, per node {nodes:?}", holdings.len());
    report_aborts(&before, &mut conns);
    assert!(
        broken.is_empty(),
        "overlapping holdings or fences not increasing ({}):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// One holding of the lease: its fence, when it was granted and when its last acknowledged
/// renewal (or the grant) said it expires, and the node.
#[derive(Debug, Clone)]
struct Holding {
    node: usize,
    fence: i64,
    acquired: chrono::DateTime<chrono::Utc>,
    expires: chrono::DateTime<chrono::Utc>,
}

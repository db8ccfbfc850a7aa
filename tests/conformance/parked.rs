//! Parked jobs (`JobContext::park`, `jobs::enqueue_parked`, `complete_parked`, `fail_parked`,
//! `resume_parked`, `expire_parked`): a token answers its job exactly once (two threads with
//! the same token: one wins; an answer racing the deadline: one wins), a wrong, guessed,
//! reused or stale token is refused with a typed error and changes nothing, an answer that
//! comes before the handler returned is applied once when the run parks, a parked job holds
//! no claim and no slot, is counted, is not an end for `wait`, can be cancelled and is never
//! pruned, and a completion releases its dependents as any completion does.

use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::jobs::{
    self, Backoff, Finished, JobResult, JobState, NewJob, ParkRefusal, ParkToken, ParkedOutcome,
    Retention,
};
use tenure::worker::{JobContext, JobError, Worker, WorkerHandle};
use tenure::{AnyConnection, Backend, Error, Pool};

use crate::common::{TestDb, conformance, contest, count, job_state, wait_until};

conformance!(
    a_handler_parks_and_its_token_completes_the_job_once_with_its_result,
    an_answer_before_the_handler_returned_is_applied_once_when_it_parks,
    two_threads_with_one_token_complete_the_job_once_and_release_its_dependent_once,
    an_answer_racing_the_deadline_exactly_one_wins,
    wrong_guessed_reused_and_stale_tokens_are_refused_and_change_nothing,
    a_parked_job_is_not_claimed_holds_no_slot_is_counted_and_is_cancelled_not_pruned,
    a_resumed_job_runs_again_and_reads_the_value,
    failures_and_the_deadline_retry_with_the_kinds_backoff_then_die,
);

const LONG: Duration = Duration::from_secs(120);
const HOUR: Duration = Duration::from_secs(3600);

/// A worker whose handler of kind `park` parks each run with `deadline` and sends the token
/// out; with a resume value it completes with that value as its result instead.
fn parking_worker(pool: &Pool, deadline: Duration) -> (WorkerHandle, Receiver<ParkToken>) {
    let (tokens, received) = channel::<ParkToken>();
    let tokens = Mutex::new(tokens);
    let worker = Worker::builder(pool.clone())
        .queue("p")
        .threads(2)
        .poll_interval(Duration::from_millis(50))
        .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
            if let Some(value) = ctx.resume_value()? {
                ctx.set_result(value);
                return Ok(());
            }
            let token = ctx.park(deadline)?;
            tokens.lock().unwrap().send(token).unwrap();
            Err(JobError::parked())
        })
        .kind_backoff(
            "park",
            Backoff {
                base: Duration::from_millis(1),
                max: Duration::from_millis(1),
            },
        )
        .start()
        .unwrap();
    (worker, received)
}

fn parked_job(queue: &str) -> NewJob {
    NewJob::new(queue, "park", b"0".to_vec())
}

fn refusal(result: tenure::Result<ParkedOutcome>) -> ParkRefusal {
    match result {
        Err(Error::ParkTokenRefused(why)) => why,
        other => panic!("expected a refused token, got {other:?}"),
    }
}

fn wait_for_state(conn: &mut AnyConnection, id: i64, state: JobState) {
    wait_until(&format!("job {id} {}", state.as_str()), LONG, || {
        (job_state(conn, id) == state).then_some(())
    });
}

fn a_handler_parks_and_its_token_completes_the_job_once_with_its_result(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (worker, tokens) = parking_worker(&pool, HOUR);
    let id = jobs::enqueue(&mut conn, &parked_job("p")).unwrap().id;
    let token = tokens.recv_timeout(LONG).unwrap();
    assert_eq!(token.job_id(), id);
    wait_for_state(&mut conn, id, JobState::Parked);
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!((job.claim_expires_at, job.finished_at), (None, None));
    // Only the hash is stored: the secret is nowhere in the park's row.
    let secret = token.expose_secret();
    let hex = secret.split_once('.').unwrap().1;
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_parked WHERE answered_at IS NULL"
        ),
        1
    );
    let stored: Vec<u8> = {
        use tenure::diesel::prelude::*;
        use tenure::schema::tenure_parked;
        tenure_parked::table
            .find(id)
            .select(tenure_parked::token_hash)
            .first(&mut conn)
            .unwrap()
    };
    assert_eq!(stored.len(), 32);
    assert!(!format!("{stored:02x?}").contains(&hex[..8]));

    let result = JobResult::json(&"paid").unwrap();
    let outcome = jobs::complete_parked(&mut conn, &token, Some(&result)).unwrap();
    assert_eq!(outcome, ParkedOutcome::Applied);
    let ended = jobs::wait(&pool, id, LONG).unwrap();
    assert_eq!(ended.job.state, JobState::Completed);
    assert_eq!(
        jobs::result(&mut conn, id)
            .unwrap()
            .unwrap()
            .decode::<String>()
            .unwrap(),
        "paid"
    );
    // Once: a second answer is refused, whatever it asks.
    assert_eq!(
        refusal(jobs::complete_parked(&mut conn, &token, None)),
        ParkRefusal::Used
    );
    assert_eq!(
        refusal(jobs::fail_parked(&mut conn, &token, "x")),
        ParkRefusal::Used
    );
    assert_eq!(
        jobs::get(&mut conn, id).unwrap().unwrap().state,
        JobState::Completed
    );
    let report = worker.shutdown(LONG);
    assert_eq!((report.parked, report.completed), (1, 0), "{report:?}");
}

/// The handler parks, hands its token to the test, and returns only once the test answered
/// it: the answer is accepted (the job still running), and applied once when the worker
/// records the park. Rounds alternate complete and fail.
fn an_answer_before_the_handler_returned_is_applied_once_when_it_parks(backend: Backend) {
    const ROUNDS: usize = 10;
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (tokens, received) = channel::<ParkToken>();
    let (go, gate) = channel::<()>();
    let (tokens, gate) = (Mutex::new(tokens), Mutex::new(gate));
    let worker = Worker::builder(pool.clone())
        .queue("early")
        .handler("park", move |ctx: &JobContext, _: serde_json::Value| {
            let token = ctx.park(HOUR)?;
            tokens.lock().unwrap().send(token).unwrap();
            gate.lock().unwrap().recv_timeout(LONG).unwrap();
            Err(JobError::parked())
        })
        .start()
        .unwrap();
    for round in 0..ROUNDS {
        let job = parked_job("early").max_attempts(1);
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        let token = received.recv_timeout(LONG).unwrap();
        let result = JobResult::json(&round).unwrap();
        let outcome = if round % 2 == 0 {
            jobs::complete_parked(&mut conn, &token, Some(&result)).unwrap()
        } else {
            jobs::fail_parked(&mut conn, &token, "declined").unwrap()
        };
        assert_eq!(outcome, ParkedOutcome::Accepted);
        assert_eq!(job_state(&mut conn, id), JobState::Running);
        // Accepted is a use: a second answer is refused.
        assert_eq!(
            refusal(jobs::complete_parked(&mut conn, &token, None)),
            ParkRefusal::Used
        );
        go.send(()).unwrap();
        let ended = jobs::wait(&pool, id, LONG).unwrap();
        if round % 2 == 0 {
            assert_eq!(ended.job.state, JobState::Completed);
            assert_eq!(
                jobs::result(&mut conn, id).unwrap().unwrap(),
                result,
                "round {round}"
            );
        } else {
            assert_eq!(ended.job.state, JobState::Dead);
            let history = jobs::history(&mut conn, id).unwrap();
            assert_eq!(history.len(), 1, "failed once: {history:?}");
            assert_eq!(history[0].error, "declined");
        }
    }
    let report = worker.shutdown(LONG);
    assert_eq!(report.parked, ROUNDS, "{report:?}");
}

fn two_threads_with_one_token_complete_the_job_once_and_release_its_dependent_once(
    backend: Backend,
) {
    const ROUNDS: usize = 40;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let current: Arc<Mutex<Option<(ParkToken, i64)>>> = Arc::default();
    let next = |conn: &mut AnyConnection| {
        let parked = jobs::enqueue_parked(conn, &parked_job("r"), HOUR).unwrap();
        let dependent = NewJob::new("r", "after", vec![]).depends_on([parked.id]);
        let dependent = jobs::enqueue(conn, &dependent).unwrap().id;
        (parked.token, dependent)
    };
    *current.lock().unwrap() = Some(next(&mut conn));
    let shared = current.clone();
    let mut wins = 0;
    contest(
        &db,
        2,
        ROUNDS,
        move |round, thread, conn| {
            let (token, _) = shared.lock().unwrap().clone().unwrap();
            let result = JobResult::json(&(round, thread)).unwrap();
            jobs::complete_parked(conn, &token, Some(&result))
        },
        |round, outcomes| {
            let (token, dependent) = current.lock().unwrap().take().unwrap();
            let won: Vec<usize> = (0..2)
                .filter(|i| matches!(outcomes[*i], Ok(ParkedOutcome::Applied)))
                .collect();
            assert_eq!(won.len(), 1, "round {round}: {outcomes:?}");
            let loser = 1 - won[0];
            assert!(
                matches!(
                    outcomes[loser],
                    Err(Error::ParkTokenRefused(ParkRefusal::Used))
                ),
                "round {round}: {outcomes:?}"
            );
            wins += 1;
            let id = token.job_id();
            assert_eq!(job_state(&mut conn, id), JobState::Completed);
            let stored = jobs::result(&mut conn, id).unwrap().unwrap();
            assert_eq!(stored.decode::<(usize, usize)>().unwrap(), (round, won[0]));
            // Released once: waiting, its dependency counted once.
            assert_eq!(job_state(&mut conn, dependent), JobState::Waiting);
            let pending = count(
                &mut conn,
                &format!(
                    "SELECT COALESCE(SUM(pending), 0) AS n FROM tenure_dependency_stripes \
                     WHERE job_id = {dependent}"
                ),
            );
            assert_eq!(pending, 0, "round {round}");
            if round + 1 < ROUNDS {
                *current.lock().unwrap() = Some(next(&mut conn));
            }
        },
    );
    assert_eq!(wins, ROUNDS);
}

/// Each round a job parked with a deadline of 30 ms; one thread answers it after a random
/// pause of up to 60 ms, another runs the deadline's expiry until the job is no longer
/// parked. Exactly one wins: the completion (and the expiry then finds nothing) or the
/// expiry (the job failed, retried: parked at enqueue it had used no attempt; and the
/// completion is refused as no longer parked). Both counted.
fn an_answer_racing_the_deadline_exactly_one_wins(backend: Backend) {
    const ROUNDS: usize = 40;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let current: Arc<Mutex<Option<ParkToken>>> = Arc::default();
    let next = |conn: &mut AnyConnection| {
        let job = parked_job("d").max_attempts(1);
        jobs::enqueue_parked(conn, &job, Duration::from_millis(30))
            .unwrap()
            .token
    };
    *current.lock().unwrap() = Some(next(&mut conn));
    let shared = current.clone();
    let (mut completed, mut expired) = (0, 0);
    contest(
        &db,
        2,
        ROUNDS,
        move |_, thread, conn| {
            let token = shared.lock().unwrap().clone().unwrap();
            if thread == 0 {
                std::thread::sleep(Duration::from_millis(rand_below(60)));
                let outcome = jobs::complete_parked(conn, &token, None);
                (Some(outcome), false)
            } else {
                let mut mine = false;
                wait_until("the job no longer parked", LONG, || {
                    mine |= jobs::expire_parked(conn, 100)
                        .unwrap()
                        .contains(&token.job_id());
                    (job_state(conn, token.job_id()) != JobState::Parked).then_some(())
                });
                (None, mine)
            }
        },
        |round, outcomes| {
            let token = current.lock().unwrap().take().unwrap();
            let answer = outcomes[0].0.as_ref().unwrap();
            let expiry_won = outcomes[1].1;
            let state = job_state(&mut conn, token.job_id());
            match answer {
                Ok(ParkedOutcome::Applied) => {
                    assert!(!expiry_won, "round {round}: both won");
                    assert_eq!(state, JobState::Completed);
                    completed += 1;
                }
                Err(Error::ParkTokenRefused(ParkRefusal::NotParked)) => {
                    assert!(expiry_won, "round {round}: neither won");
                    assert_eq!(state, JobState::Waiting, "round {round}");
                    let history = jobs::history(&mut conn, token.job_id()).unwrap();
                    assert_eq!(history.len(), 1, "round {round}: {history:?}");
                    expired += 1;
                }
                other => panic!("round {round}: {other:?}"),
            }
            if round + 1 < ROUNDS {
                *current.lock().unwrap() = Some(next(&mut conn));
            }
        },
    );
    eprintln!("{backend}: {completed} completed first, {expired} expired first");
    assert_eq!(completed + expired, ROUNDS);
}

/// A number below `n`, for pauses that vary between rounds.
fn rand_below(n: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    u64::from(nanos) % n
}

/// Everything a refusal must leave alone: the job's row and its park's.
fn snapshot(conn: &mut AnyConnection, id: i64) -> String {
    use tenure::diesel::prelude::*;
    use tenure::schema::tenure_parked;
    let job = jobs::get(conn, id).unwrap();
    let park: Vec<(Option<String>, Vec<u8>)> = tenure_parked::table
        .filter(tenure_parked::job_id.eq(id))
        .select((tenure_parked::answer, tenure_parked::token_hash))
        .load(conn)
        .unwrap();
    format!("{job:?} {park:?} {:?}", jobs::result(conn, id).unwrap())
}

fn wrong_guessed_reused_and_stale_tokens_are_refused_and_change_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = jobs::enqueue_parked(&mut conn, &parked_job("t"), HOUR).unwrap();
    let b = jobs::enqueue_parked(&mut conn, &parked_job("t"), HOUR).unwrap();
    let before = (snapshot(&mut conn, a.id), snapshot(&mut conn, b.id));
    let secret_of =
        |token: &ParkToken| token.expose_secret().split_once('.').unwrap().1.to_string();
    let guesses = [
        // Malformed.
        String::new(),
        "garbage".to_string(),
        format!("{}.", a.id),
        format!("{}.{}", a.id, &secret_of(&a.token)[..63]),
        // Guessed: the right id, another secret.
        format!("{}.{}", a.id, "0".repeat(64)),
        format!("{}.{}", a.id, "f".repeat(64)),
        // Job a's secret on job b, and on a job that does not exist.
        format!("{}.{}", b.id, secret_of(&a.token)),
        format!("{}.{}", b.id + 1000, secret_of(&a.token)),
    ];
    for guess in &guesses {
        let refused: tenure::Result<()> = guess.parse::<ParkToken>().and_then(|token| {
            let outcomes = [
                jobs::complete_parked(&mut conn, &token, None),
                jobs::fail_parked(&mut conn, &token, "x"),
                jobs::resume_parked(&mut conn, &token, None),
            ];
            for outcome in outcomes {
                assert_eq!(refusal(outcome), ParkRefusal::Invalid, "{guess:?}");
            }
            Err(Error::ParkTokenRefused(ParkRefusal::Invalid))
        });
        let error = refused.unwrap_err();
        assert!(matches!(
            error,
            Error::ParkTokenRefused(ParkRefusal::Invalid)
        ));
        // The error says nothing of the token.
        let said = format!("{error} {error:?}");
        assert!(!said.contains(&secret_of(&a.token)[..16]), "{said}");
    }
    assert_eq!(
        (snapshot(&mut conn, a.id), snapshot(&mut conn, b.id)),
        before,
        "a refused token changed something"
    );
    // Nor does a token's Debug show its secret.
    assert!(!format!("{:?}", a.token).contains(&secret_of(&a.token)[..16]));

    // Reused: a's first answer wins, every later one is refused and changes nothing.
    jobs::resume_parked(&mut conn, &a.token, None).unwrap();
    let resumed = snapshot(&mut conn, a.id);
    for _ in 0..2 {
        assert_eq!(
            refusal(jobs::complete_parked(&mut conn, &a.token, None)),
            ParkRefusal::Used
        );
        assert_eq!(
            refusal(jobs::resume_parked(&mut conn, &a.token, None)),
            ParkRefusal::Used
        );
    }
    assert_eq!(snapshot(&mut conn, a.id), resumed);

    // Stale: b cancelled, then its token is refused as no longer parked.
    assert!(jobs::cancel(&mut conn, b.id).unwrap());
    let cancelled = snapshot(&mut conn, b.id);
    assert_eq!(
        refusal(jobs::complete_parked(&mut conn, &b.token, None)),
        ParkRefusal::NotParked
    );
    assert_eq!(snapshot(&mut conn, b.id), cancelled);

    // Past its deadline (database clock) before any expiry ran: refused, nothing changed.
    let c = jobs::enqueue_parked(&mut conn, &parked_job("t"), Duration::ZERO).unwrap();
    let parked = snapshot(&mut conn, c.id);
    assert_eq!(
        refusal(jobs::complete_parked(&mut conn, &c.token, None)),
        ParkRefusal::NotParked
    );
    assert_eq!(snapshot(&mut conn, c.id), parked);
    assert_eq!(jobs::expire_parked(&mut conn, 100).unwrap(), vec![c.id]);
    assert_eq!(
        refusal(jobs::complete_parked(&mut conn, &c.token, None)),
        ParkRefusal::NotParked
    );
    // Bad input to parking itself: a dedup key, dependencies, a deadline past 366 days.
    for job in [
        parked_job("t").dedup_key("k"),
        parked_job("t").depends_on([a.id]),
    ] {
        assert!(
            jobs::enqueue_parked(&mut conn, &job, HOUR)
                .unwrap_err()
                .is_invalid_input()
        );
    }
    let too_long = Duration::from_secs(367 * 86_400);
    assert!(
        jobs::enqueue_parked(&mut conn, &parked_job("t"), too_long)
            .unwrap_err()
            .is_invalid_input()
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        3,
        "a refused enqueue made a job"
    );
}

fn a_parked_job_is_not_claimed_holds_no_slot_is_counted_and_is_cancelled_not_pruned(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (worker, tokens) = parking_worker(&pool, HOUR);
    // One at a time by its key: a parked job must not hold the slot.
    let first = jobs::enqueue(&mut conn, &parked_job("p").limit("acct", 1))
        .unwrap()
        .id;
    let _token = tokens.recv_timeout(LONG).unwrap();
    wait_for_state(&mut conn, first, JobState::Parked);
    let second = jobs::enqueue(&mut conn, &parked_job("p").limit("acct", 1))
        .unwrap()
        .id;
    let _token2 = tokens.recv_timeout(LONG).unwrap();
    wait_for_state(&mut conn, second, JobState::Parked);
    worker.shutdown(LONG);
    // Not claimable.
    assert!(jobs::claim(&mut conn, "p", 10, HOUR).unwrap().is_empty());
    // Counted wherever states are.
    let stats = jobs::stats(&mut conn).unwrap();
    let queue = stats.queues.iter().find(|q| q.queue == "p").unwrap();
    assert_eq!((queue.parked, queue.running, queue.waiting), (2, 0, 0));
    assert_eq!(jobs::queue_counts(&mut conn, "p", 100).unwrap().parked, 2);
    let listed = jobs::list(
        &mut conn,
        &jobs::JobFilter {
            state: Some(JobState::Parked),
            ..jobs::JobFilter::default()
        },
    )
    .unwrap();
    assert_eq!(listed.len(), 2);
    // Not an end for wait.
    match jobs::wait(&pool, first, Duration::from_millis(200)) {
        Err(Error::WaitTimedOut { state, .. }) => assert_eq!(state, JobState::Parked),
        other => panic!("{other:?}"),
    }
    // Never pruned, whatever the policy.
    for finished in [Finished::Completed, Finished::Dead, Finished::Cancelled] {
        jobs::prune(&mut conn, "p", finished, Retention::DeleteAll, 100).unwrap();
    }
    assert_eq!(job_state(&mut conn, first), JobState::Parked);
    // Cancelled at once (it is not final).
    assert!(jobs::cancel(&mut conn, first).unwrap());
    assert_eq!(job_state(&mut conn, first), JobState::Cancelled);
    assert_eq!(
        jobs::wait(&pool, first, LONG).unwrap().job.state,
        JobState::Cancelled
    );
    // Its park is closed by the next expiry pass once its deadline passes; meanwhile
    // the cancelled job's row is pruned with its park.
    jobs::prune(
        &mut conn,
        "p",
        Finished::Cancelled,
        Retention::DeleteAll,
        100,
    )
    .unwrap();
    assert!(jobs::get(&mut conn, first).unwrap().is_none());
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT COUNT(*) AS n FROM tenure_parked WHERE job_id = {first}")
        ),
        0
    );
}

fn a_resumed_job_runs_again_and_reads_the_value(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    let (worker, tokens) = parking_worker(&pool, HOUR);
    let id = jobs::enqueue(&mut conn, &parked_job("p")).unwrap().id;
    let token = tokens.recv_timeout(LONG).unwrap();
    wait_for_state(&mut conn, id, JobState::Parked);
    let value = JobResult::json(&"approved by ada").unwrap();
    jobs::resume_parked(&mut conn, &token, Some(&value)).unwrap();
    let ended = jobs::wait(&pool, id, LONG).unwrap();
    assert_eq!(ended.job.state, JobState::Completed);
    // The resumed run continued the first: one attempt used.
    assert_eq!(ended.job.attempt, 1);
    assert_eq!(jobs::result(&mut conn, id).unwrap().unwrap(), value);
    let report = worker.shutdown(LONG);
    assert_eq!((report.parked, report.completed), (1, 1), "{report:?}");
}

/// `fail_parked` and a deadline passing are failed runs: retried with the kind's backoff
/// (recorded at park) while attempts remain, then dead; the deadline is enforced by the
/// worker's own maintenance.
fn failures_and_the_deadline_retry_with_the_kinds_backoff_then_die(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(10);
    let mut conn = db.connect();
    // Attempt 1 failed by its token, attempt 2 by its deadline (the worker's maintenance).
    let (worker, tokens) = parking_worker(&pool, Duration::from_secs(2));
    let id = jobs::enqueue(&mut conn, &parked_job("p").max_attempts(2))
        .unwrap()
        .id;
    let first = tokens.recv_timeout(LONG).unwrap();
    wait_for_state(&mut conn, id, JobState::Parked);
    assert_eq!(
        jobs::fail_parked(&mut conn, &first, "card declined").unwrap(),
        ParkedOutcome::Applied
    );
    // Retried (1 ms backoff): it runs and parks again, and its deadline passes.
    let _second = tokens.recv_timeout(LONG).unwrap();
    let ended = jobs::wait(&pool, id, LONG).unwrap();
    assert_eq!(ended.job.state, JobState::Dead);
    assert_eq!(ended.job.attempt, 2);
    let errors: Vec<String> = jobs::history(&mut conn, id)
        .unwrap()
        .into_iter()
        .map(|run| run.error)
        .collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_eq!(errors[0], "card declined");
    assert!(errors[1].contains("deadline"), "{errors:?}");
    // The job's park row is its last park: an earlier park's token is not a token of it.
    assert_eq!(
        refusal(jobs::complete_parked(&mut conn, &first, None)),
        ParkRefusal::Invalid
    );
    worker.shutdown(LONG);
}

//! Attacks on the kinds claim, snooze, typed jobs, events and `tenure::testing` (round 5).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use serde::{Deserialize, Serialize};
use tenure::Backend;
use tenure::jobs::{self, JobArgs, JobState, NewJob};
use tenure::worker::{Event, JobContext, JobError, RunOutcome, Worker};

use crate::common::{TestDb, conformance, contest, wait_for};

conformance!(
    a_snooze_that_uses_the_last_attempt_is_reported_dead,
    a_panicking_event_hook_neither_wedges_the_worker_nor_loses_runs,
    drain_survives_a_panicking_event_hook,
    a_timeout_too_long_for_an_instant_does_not_stop_the_heartbeat,
    overlapping_kind_sets_race_without_double_claims_or_strangers,
    a_limit_key_shared_by_kinds_holds_across_kinds_and_claimers,
    odd_kind_names_match_exactly,
    job_context_times_are_the_rows_and_the_events,
    bad_typed_consts_are_typed_errors_and_change_nothing,
    a_drain_hook_may_use_a_pool_of_one,
    drain_ends_when_handlers_enqueue_forever,
);

/// Collects a worker's run events.
fn run_events() -> (
    Arc<Mutex<Vec<tenure::worker::RunEvent>>>,
    impl Fn(&Event) + Send + Sync + 'static,
) {
    let events: Arc<Mutex<Vec<tenure::worker::RunEvent>>> = Arc::default();
    let sink = events.clone();
    (events, move |event: &Event| {
        if let Event::Run(run) = event {
            sink.lock().unwrap().push(run.clone());
        }
    })
}

fn wait_state(pool: &tenure::Pool, id: i64, state: JobState, limit: Duration) -> jobs::Job {
    let until = Instant::now() + limit;
    loop {
        let job = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
        if job.state == state || Instant::now() > until {
            return job;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A job one snooze short of the free ones, with two attempts, that always snoozes: a free
/// snooze, a paid one (attempt 1 used), then a snooze with no attempt left kills it. The
/// database says dead: so must the event and the report (not "snoozed").
fn a_snooze_that_uses_the_last_attempt_is_reported_dead(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = pool.get().unwrap();
    let id = jobs::enqueue(&mut conn, &NewJob::new("sz", "nap", vec![]).max_attempts(2))
        .unwrap()
        .id;
    let free_left = jobs::MAX_FREE_SNOOZES - 1;
    diesel::sql_query(format!(
        "UPDATE tenure_jobs SET snoozes = {free_left} WHERE id = {id}"
    ))
    .execute(&mut db.connect())
    .unwrap();
    drop(conn);
    let (events, hook) = run_events();
    let report = Worker::builder(pool.clone())
        .queue("sz")
        .raw_handler("nap", |_: &JobContext, _: &[u8]| {
            Err(JobError::snooze(Duration::ZERO))
        })
        .on_event(hook)
        .drain()
        .unwrap();
    let stored = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
    assert_eq!(stored.state, JobState::Dead, "{stored:?}");
    assert_eq!(
        (stored.attempt, stored.snoozes),
        (2, jobs::MAX_FREE_SNOOZES + 2)
    );
    let events = events.lock().unwrap().clone();
    let seen: Vec<(u32, RunOutcome)> = events.iter().map(|e| (e.attempt, e.outcome)).collect();
    assert_eq!(
        seen,
        vec![
            (1, RunOutcome::Snoozed),
            (1, RunOutcome::Snoozed),
            (2, RunOutcome::Dead)
        ],
        "the events must say what the database recorded; report {report:?}"
    );
    assert_eq!((report.snoozed, report.dead), (2, 1), "{report:?}");
    let error = events[2].error.clone().unwrap_or_default();
    assert!(error.contains("out of attempts"), "{error:?}");
}

/// An `on_event` hook that panics (a user bug) must not stop the worker recording runs: a
/// job finished after the panic is still recorded (not held, renewed, forever), other hooks
/// still get every run, and shutdown returns.
fn a_panicking_event_hook_neither_wedges_the_worker_nor_loses_runs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(6);
    let (events, hook) = run_events();
    let worker = Worker::builder(pool.clone())
        .queue("ph")
        .threads(1)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
        .on_event(|event: &Event| {
            if matches!(event, Event::Run(_)) {
                panic!("a hook with a bug");
            }
        })
        .on_event(hook)
        .start()
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("ph", "k", vec![]))
            .unwrap()
            .id;
        let job = wait_state(&pool, id, JobState::Completed, Duration::from_secs(25));
        assert_eq!(job.state, JobState::Completed, "{job:?}");
        ids.push(id);
    }
    let report = wait_for(&worker, Duration::from_secs(30), |r| r.completed == 3);
    assert_eq!(report.completed, 3, "{report:?}");
    let report = worker.shutdown(Duration::from_secs(5));
    assert_eq!(report.completed, 3, "{report:?}");
    let mut seen: Vec<i64> = events.lock().unwrap().iter().map(|e| e.id).collect();
    seen.sort_unstable();
    assert_eq!(seen, ids, "the second hook gets every run");
}

/// `drain` with a hook that panics: every job still runs and is recorded once.
fn drain_survives_a_panicking_event_hook(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    for _ in 0..3 {
        jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("dp", "k", vec![])).unwrap();
    }
    let drained = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Worker::builder(pool.clone())
            .queue("dp")
            .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
            .on_event(|_: &Event| panic!("a hook with a bug"))
            .drain()
    }));
    let report = drained
        .expect("drain must not unwind out from a hook's panic")
        .unwrap();
    assert_eq!(report.completed, 3, "{report:?}");
}

#[derive(Serialize, Deserialize)]
struct Forever;

impl JobArgs for Forever {
    const KIND: &'static str = "forever";
    const QUEUE: &'static str = "to";
    // "No real timeout": must not panic the heartbeat (Instant + Duration::MAX overflows).
    const TIMEOUT: Option<Duration> = Some(Duration::MAX);
}

/// A type whose TIMEOUT is too long for an `Instant`: either the builder refuses it (a typed
/// error) or the worker runs it; its heartbeat must keep renewing the claim either way. The
/// handler waits until it sees its claim renewed (or lapsed: rescued, a lapse counted).
fn a_timeout_too_long_for_an_instant_does_not_stop_the_heartbeat(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(6);
    let id = jobs::enqueue_job(&mut pool.get().unwrap(), &Forever)
        .unwrap()
        .id;
    let ttl = Duration::from_secs(6);
    let verdicts: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let (sink, handler_pool) = (verdicts.clone(), pool.clone());
    let started = Worker::builder(pool.clone())
        .threads(2)
        .claim_ttl(ttl)
        .register(move |ctx: &JobContext, _: Forever| {
            let until = Instant::now() + Duration::from_secs(90);
            let verdict = loop {
                let job = jobs::get(&mut handler_pool.get()?, ctx.id)?.unwrap();
                if job.lapses > 0 {
                    break "lapsed";
                }
                let renewed = job
                    .claim_expires_at
                    .is_some_and(|at| at > ctx.claimed_at + ttl);
                if renewed {
                    break "renewed";
                }
                if Instant::now() > until {
                    break "neither";
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            sink.lock().unwrap().push(verdict);
            Ok(())
        })
        .start();
    let worker = match started {
        Err(e) => {
            assert!(e.is_invalid_input(), "{e}");
            return;
        }
        Ok(worker) => worker,
    };
    let job = wait_state(&pool, id, JobState::Completed, Duration::from_secs(120));
    let report = worker.shutdown(Duration::from_secs(5));
    assert_eq!(job.state, JobState::Completed, "{job:?} {report:?}");
    assert_eq!(job.lapses, 0, "{job:?}");
    assert_eq!(verdicts.lock().unwrap().first(), Some(&"renewed"));
}

/// A handler that enqueues another job every run: drain runs jobs handlers enqueue, and must
/// also end. The handler stops enqueueing after a safety cap so the test itself ends; the
/// drain should have stopped (an error, or a report) well before.
fn drain_ends_when_handlers_enqueue_forever(backend: Backend) {
    const CAP: usize = 2000;
    const LIMIT: usize = 300;
    let db = TestDb::migrated(backend);
    let pool = db.pool(1);
    jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("ef", "k", vec![])).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (counter, handler_pool) = (runs.clone(), pool.clone());
    let drained = Worker::builder(pool.clone())
        .queue("ef")
        .drain_limit(LIMIT)
        .raw_handler("k", move |_: &JobContext, _: &[u8]| {
            if counter.fetch_add(1, Ordering::SeqCst) < CAP {
                jobs::enqueue(&mut handler_pool.get()?, &NewJob::new("ef", "k", vec![]))?;
            }
            Ok(())
        })
        .drain();
    let runs = runs.load(Ordering::SeqCst);
    assert_eq!(runs, LIMIT, "the drain stops at its limit: {drained:?}");
    let err = drained.expect_err("a drain stopped by its limit says so");
    assert!(
        matches!(err, tenure::Error::Timeout { .. }) && err.to_string().contains("drain_limit"),
        "{err}"
    );
    // The job it found still due was given back, unstarted, no attempt used.
    let mut conn = pool.get().unwrap();
    let waiting = jobs::list(
        &mut conn,
        &jobs::JobFilter {
            queue: Some("ef".into()),
            state: Some(JobState::Waiting),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0].attempt, 0);
}

/// Six claimers with overlapping kind sets race on one queue of five kinds (one of which no
/// claimer takes): every job of a taken kind is claimed exactly once, by a claimer of its
/// kind, each claim in queue order; the other kind is untouched.
fn overlapping_kind_sets_race_without_double_claims_or_strangers(backend: Backend) {
    const SETS: [&[&str]; 6] = [
        &["a", "b"],
        &["b", "c"],
        &["c", "a"],
        &["a"],
        &["b", "c", "d", "b"],
        &["d"],
    ];
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let kinds = ["a", "b", "c", "d", "e"];
    let mut by_kind: HashMap<i64, &str> = HashMap::new();
    for i in 0..250 {
        let kind = kinds[i % kinds.len()];
        let job = NewJob::new("ov", kind, vec![]).priority((i * 7 % 5) as i32);
        by_kind.insert(jobs::enqueue(&mut conn, &job).unwrap().id, kind);
    }
    let claimed: Arc<Mutex<Vec<(usize, i64)>>> = Arc::default();
    let sink = claimed.clone();
    contest(
        &db,
        SETS.len(),
        60,
        move |_, i, conn| {
            let got = jobs::claim_kinds(conn, "ov", SETS[i], 3, Duration::from_secs(600))
                .unwrap_or_else(|e| panic!("claimer {i}: {e}"));
            let keys: Vec<_> = got.iter().map(|j| (j.priority, j.due_at, j.id)).collect();
            let mut sorted = keys.clone();
            sorted.sort();
            assert_eq!(keys, sorted, "a claim out of order");
            let mut sink = sink.lock().unwrap();
            for job in got {
                assert!(SETS[i].contains(&job.kind.as_str()), "{job:?} by {i}");
                sink.push((i, job.id));
            }
        },
        |_, _| {},
    );
    let claimed = claimed.lock().unwrap();
    let mut once = HashSet::new();
    for (i, id) in claimed.iter() {
        assert!(once.insert(*id), "job {id} claimed twice (last by {i})");
    }
    for (id, kind) in &by_kind {
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        if *kind == "e" {
            assert_eq!((job.state, job.attempt), (JobState::Waiting, 0), "{job:?}");
        } else {
            assert!(once.contains(id), "{job:?} never claimed");
            assert_eq!(job.state, JobState::Running, "{job:?}");
        }
    }
}

/// Jobs of three kinds share one limit key (at most 2 running). Claimers of one kind each
/// and one of all three race, many rounds: never more than 2 running; between rounds the
/// judge completes what runs.
fn a_limit_key_shared_by_kinds_holds_across_kinds_and_claimers(backend: Backend) {
    const SETS: [&[&str]; 4] = [&["x"], &["y"], &["z"], &["x", "y", "z"]];
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for i in 0..120 {
        let kind = ["x", "y", "z"][i % 3];
        jobs::enqueue(
            &mut conn,
            &NewJob::new("lk", kind, vec![]).limit("shared", 2),
        )
        .unwrap();
    }
    // One claim of all three kinds takes at most 2.
    let first = jobs::claim_kinds(
        &mut conn,
        "lk",
        &["x", "y", "z"],
        10,
        Duration::from_secs(600),
    )
    .unwrap();
    assert_eq!(first.len(), 2, "{first:?}");
    let claims: Vec<_> = first.iter().map(|j| j.claim()).collect();
    jobs::complete(&mut conn, &claims).unwrap();
    let held: Arc<Mutex<Vec<jobs::JobClaim>>> = Arc::default();
    let sink = held.clone();
    let mut judge_conn = db.connect();
    contest(
        &db,
        SETS.len(),
        40,
        move |_, i, conn| {
            let got = jobs::claim_kinds(conn, "lk", SETS[i], 5, Duration::from_secs(600))
                .unwrap_or_else(|e| panic!("claimer {i}: {e}"));
            sink.lock().unwrap().extend(got.iter().map(|j| j.claim()));
            got.len()
        },
        move |round, got| {
            let mut held = held.lock().unwrap();
            assert!(held.len() <= 2, "round {round}: {got:?} claimed, limit 2");
            if !held.is_empty() {
                jobs::complete(&mut judge_conn, &held).unwrap();
            }
            held.clear();
        },
    );
}

/// Kinds that differ by case, a trailing space, an accent, LIKE wildcards, quotes or
/// backslashes are different kinds; a 255-byte kind and 100 kinds in one claim work; a
/// repeated kind is harmless; 101 kinds are refused.
fn odd_kind_names_match_exactly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let long = "é".repeat(127) + "z";
    let names: Vec<String> = vec![
        "a".into(),
        "A".into(),
        "a ".into(),
        " a".into(),
        "á".into(),
        "a%".into(),
        "_".into(),
        "'a'".into(),
        "\"a\"".into(),
        "a\\".into(),
        "a'); DELETE FROM tenure_jobs; --".into(),
        "日本".into(),
        long.clone(),
        "k".repeat(255),
    ];
    let mut ids = HashMap::new();
    for name in &names {
        let id = jobs::enqueue(&mut conn, &NewJob::new("odd", name.as_str(), vec![]))
            .unwrap()
            .id;
        ids.insert(name.clone(), id);
    }
    for name in &names {
        let got = jobs::claim_kinds(
            &mut conn,
            "odd",
            &[name.as_str(), name.as_str()],
            10,
            Duration::from_secs(600),
        )
        .unwrap();
        let got: Vec<i64> = got.iter().map(|j| j.id).collect();
        assert_eq!(got, vec![ids[name]], "kind {name:?}");
    }
    let mut many: Vec<String> = (0..99).map(|i| format!("none-{i}")).collect();
    many.push("later".into());
    let later = jobs::enqueue(&mut conn, &NewJob::new("odd", "later", vec![]))
        .unwrap()
        .id;
    let got = jobs::claim_kinds(&mut conn, "odd", &many, 10, Duration::from_secs(600)).unwrap();
    assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![later]);
    many.push("one-too-many".into());
    let refused = jobs::claim_kinds(&mut conn, "odd", &many, 10, Duration::from_secs(600));
    assert!(refused.unwrap_err().is_invalid_input());
    // A paused queue gives nothing to a kinds claim either.
    jobs::enqueue(&mut conn, &NewJob::new("odd", "a", vec![])).unwrap();
    jobs::pause(&mut conn, "odd").unwrap();
    let paused = jobs::claim_kinds(&mut conn, "odd", &["a"], 10, Duration::from_secs(600));
    assert!(paused.unwrap().is_empty());
}

/// A job snoozed once, then completed: each run's context times are the row's (created,
/// due, claimed), queue_wait is claimed - due and never negative, and each run's event
/// carries the same queue_wait and attempt.
fn job_context_times_are_the_rows_and_the_events(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("ct", "k", vec![]))
        .unwrap()
        .id;
    let seen: Arc<Mutex<Vec<(JobContext, jobs::Job)>>> = Arc::default();
    let (sink, handler_pool) = (seen.clone(), pool.clone());
    let (events, hook) = run_events();
    let report = Worker::builder(pool.clone())
        .queue("ct")
        .raw_handler("k", move |ctx: &JobContext, _: &[u8]| {
            let row = jobs::get(&mut handler_pool.get()?, ctx.id)?.unwrap();
            let mut sink = sink.lock().unwrap();
            sink.push((ctx.clone(), row));
            if sink.len() == 1 {
                return Err(JobError::snooze(Duration::ZERO));
            }
            Ok(())
        })
        .on_event(hook)
        .drain()
        .unwrap();
    assert_eq!((report.snoozed, report.completed), (1, 1), "{report:?}");
    let seen = seen.lock().unwrap();
    let events = events.lock().unwrap();
    assert_eq!((seen.len(), events.len()), (2, 2));
    for ((ctx, row), event) in seen.iter().zip(events.iter()) {
        assert_eq!(ctx.id, id);
        assert_eq!(ctx.enqueued_at, row.created_at, "{row:?}");
        assert_eq!(ctx.due_at, row.due_at, "{row:?}");
        assert_eq!(Some(ctx.claimed_at), row.claimed_at, "{row:?}");
        assert!(ctx.claimed_at >= ctx.due_at, "{ctx:?}");
        assert_eq!(
            ctx.queue_wait(),
            (ctx.claimed_at - ctx.due_at).to_std().unwrap()
        );
        assert_eq!(event.queue_wait, ctx.queue_wait());
        assert_eq!(event.attempt, ctx.attempt);
        assert_eq!(ctx.attempt, 1, "a free snooze uses no attempt");
    }
    assert!(
        seen[1].0.due_at >= seen[0].0.claimed_at,
        "snoozed after the run"
    );
}

macro_rules! bad_type {
    ($name:ident, $kind:expr, $($rest:tt)*) => {
        #[derive(Serialize, Deserialize)]
        struct $name;
        impl JobArgs for $name {
            const KIND: &'static str = $kind;
            const QUEUE: &'static str = "bad";
            $($rest)*
        }
    };
}
bad_type!(NoKind, "",);
bad_type!(NoAttempts, "no_attempts", const MAX_ATTEMPTS: u32 = 0;);
bad_type!(
    TooManyAttempts,
    "too_many",
    const MAX_ATTEMPTS: u32 = u32::MAX;
);
bad_type!(
    ZeroTimeout,
    "zero_timeout",
    const TIMEOUT: Option<Duration> = Some(Duration::ZERO);
);
bad_type!(
    LongBackoff,
    "long_backoff",
    const BACKOFF: Option<jobs::Backoff> = Some(jobs::Backoff {
        base: Duration::from_secs(1),
        max: Duration::from_secs(367 * 24 * 3600),
    });
);

/// Bad consts of a `JobArgs` type are typed errors where they are used (enqueue for the
/// job's own options, the builder for the worker's), never a panic, and write nothing.
fn bad_typed_consts_are_typed_errors_and_change_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let mut conn = pool.get().unwrap();
    let ok = |_: &JobContext, _: NoKind| Ok(());
    for refused in [
        jobs::enqueue_job(&mut conn, &NoKind).map(|_| ()),
        jobs::enqueue_job(&mut conn, &NoAttempts).map(|_| ()),
        jobs::enqueue_job(&mut conn, &TooManyAttempts).map(|_| ()),
        jobs::enqueue_jobs(&mut conn, &[TooManyAttempts]).map(|_| ()),
    ] {
        assert!(refused.unwrap_err().is_invalid_input());
    }
    let builders = [
        Worker::builder(pool.clone()).register(ok),
        Worker::builder(pool.clone()).register(|_: &JobContext, _: ZeroTimeout| Ok(())),
        Worker::builder(pool.clone()).register(|_: &JobContext, _: LongBackoff| Ok(())),
    ];
    for builder in builders {
        assert!(builder.drain().unwrap_err().is_invalid_input());
    }
    let n = crate::common::count(&mut db.connect(), "SELECT COUNT(*) AS n FROM tenure_jobs");
    assert_eq!(n, 0);
}

/// `drain` on a pool of one: a hook that reads the database when a run is recorded (a
/// test checking what it sees) gets a connection too, as handlers do.
fn a_drain_hook_may_use_a_pool_of_one(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = tenure::Pool::options()
        .max_size(1)
        .connection_timeout(Duration::from_secs(3))
        .open(db.url())
        .unwrap();
    let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("hp", "k", vec![]))
        .unwrap()
        .id;
    let states: Arc<Mutex<Vec<String>>> = Arc::default();
    let (sink, hook_pool) = (states.clone(), pool.clone());
    let report = Worker::builder(pool.clone())
        .queue("hp")
        .raw_handler("k", |_: &JobContext, _: &[u8]| Ok(()))
        .on_event(move |event: &Event| {
            if let Event::Run(run) = event {
                let seen = match hook_pool.get() {
                    Ok(mut conn) => format!(
                        "{:?}",
                        jobs::get(&mut conn, run.id).map(|j| j.map(|j| j.state))
                    ),
                    Err(e) => format!("no connection: {e}"),
                };
                sink.lock().unwrap().push(seen);
            }
        })
        .drain()
        .unwrap();
    assert_eq!(report.completed, 1);
    assert_eq!(
        *states.lock().unwrap(),
        vec![format!(
            "{:?}",
            Ok::<_, tenure::Error>(Some(JobState::Completed))
        )],
        "job {id}"
    );
}

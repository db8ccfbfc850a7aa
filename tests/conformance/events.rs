//! Observability: a worker's events (`on_event`) count every recorded run by outcome, each
//! rescue pass and snooze, in agreement with its report; with the `metrics` feature the same
//! counts reach a metrics recorder.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, Backoff, JobState, NewJob};
use tenure::worker::{Event, JobContext, JobError, RunOutcome, Worker};

use crate::common::{TestDb, conformance, poll_until, wait_for};

#[cfg(feature = "metrics")]
conformance!(
    events_count_runs_retries_dead_rescues_and_snoozes,
    snoozes_use_no_attempt_and_are_counted,
    tracing_has_a_span_per_run_and_a_line_per_recorded_job,
    metrics_count_what_the_worker_did,
    a_panicking_event_hook_neither_wedges_the_worker_nor_loses_runs,
    job_context_times_are_the_rows_and_the_events,
);
#[cfg(not(feature = "metrics"))]
conformance!(
    events_count_runs_retries_dead_rescues_and_snoozes,
    snoozes_use_no_attempt_and_are_counted,
    tracing_has_a_span_per_run_and_a_line_per_recorded_job,
    a_panicking_event_hook_neither_wedges_the_worker_nor_loses_runs,
    job_context_times_are_the_rows_and_the_events,
);

/// Collects a worker's events.
fn collector() -> (
    Arc<Mutex<Vec<Event>>>,
    impl Fn(&Event) + Send + Sync + 'static,
) {
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let sink = events.clone();
    (events, move |event: &Event| {
        sink.lock().unwrap().push(event.clone())
    })
}

fn run_outcomes(events: &[Event]) -> HashMap<RunOutcome, usize> {
    let mut counts = HashMap::new();
    for event in events {
        if let Event::Run(run) = event {
            *counts.entry(run.outcome).or_default() += 1;
        }
    }
    counts
}

/// A worker with every kind of end: 5 jobs that complete, 3 that fail once then complete, 2
/// that are dead at once, 1 that snoozes 5 times then completes, and 1 whose claim (by a
/// worker that "died") lapsed before the worker started: rescued, then completed.
fn events_count_runs_retries_dead_rescues_and_snoozes(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = pool.get().unwrap();
    // The job a dead worker held: claimed first (priority), its claim left to lapse.
    let abandoned = jobs::enqueue(&mut conn, &NewJob::new("ev", "ok", vec![]).priority(-100))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "ev", 1, Duration::from_millis(1)).unwrap();
    assert_eq!(claimed[0].id, abandoned);
    let mut batch = Vec::new();
    batch.extend((0..5).map(|_| NewJob::new("ev", "ok", vec![])));
    batch.extend((0..3).map(|_| NewJob::new("ev", "flaky", vec![])));
    batch.extend((0..2).map(|_| NewJob::new("ev", "doomed", vec![])));
    batch.push(NewJob::new("ev", "sleepy", vec![]));
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    drop(conn);
    // Lapsed by the database's clock before the worker's first rescue pass.
    std::thread::sleep(Duration::from_millis(50));

    let snoozes: Arc<Mutex<HashMap<i64, u32>>> = Arc::default();
    let counter = snoozes.clone();
    let (events, hook) = collector();
    let quick = Backoff {
        base: Duration::from_millis(1),
        max: Duration::from_millis(1),
    };
    let worker = Worker::builder(pool.clone())
        .queue("ev")
        .threads(2)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("ok", |_: &JobContext, _: &[u8]| Ok(()))
        .raw_handler("flaky", |ctx: &JobContext, _: &[u8]| {
            if ctx.attempt == 1 {
                Err("first try fails")?;
            }
            Ok(())
        })
        .kind_backoff("flaky", quick)
        .raw_handler("doomed", |_: &JobContext, _: &[u8]| {
            Err(JobError::dead("never"))
        })
        .raw_handler("sleepy", move |ctx: &JobContext, _: &[u8]| {
            let mut snoozes = counter.lock().unwrap();
            let n = snoozes.entry(ctx.id).or_default();
            if *n < 5 {
                *n += 1;
                return Err(JobError::snooze(Duration::ZERO));
            }
            Ok(())
        })
        .on_event(hook)
        .start()
        .unwrap();
    let report = wait_for(&worker, Duration::from_secs(60), |r| {
        r.completed >= 10 && r.dead >= 2
    });
    let report_at_end = worker.shutdown(Duration::from_secs(5));
    assert_eq!(report, report_at_end, "nothing ran after the wait");
    assert_eq!(
        (
            report.completed,
            report.retried,
            report.dead,
            report.snoozed
        ),
        (10, 3, 2, 5),
        "{report:?}"
    );
    let events = events.lock().unwrap();
    let runs = run_outcomes(&events);
    let count = |outcome| runs.get(&outcome).copied().unwrap_or(0);
    assert_eq!(count(RunOutcome::Completed), 10, "{runs:?}");
    assert_eq!(count(RunOutcome::Retried), 3, "{runs:?}");
    assert_eq!(count(RunOutcome::Dead), 2, "{runs:?}");
    assert_eq!(count(RunOutcome::Snoozed), 5, "{runs:?}");
    assert_eq!(runs.values().sum::<usize>(), 20, "no other runs: {runs:?}");
    let rescued: usize = events
        .iter()
        .map(|e| match e {
            Event::Rescued { requeued, .. } => *requeued,
            _ => 0,
        })
        .sum();
    assert_eq!(rescued, 1);
    // Each run event says what ran and how it went.
    for event in events.iter() {
        let Event::Run(run) = event else { continue };
        assert_eq!(&*run.queue, "ev");
        assert!(run.run_time.is_some(), "{run:?}");
        match (&*run.kind, run.outcome) {
            ("doomed", RunOutcome::Dead) => {
                assert_eq!(run.error.as_deref(), Some("never"));
                assert_eq!(run.attempt, 1);
            }
            ("flaky", RunOutcome::Retried) => {
                assert_eq!(run.error.as_deref(), Some("first try fails"))
            }
            ("flaky", RunOutcome::Completed) => assert_eq!(run.attempt, 2),
            ("sleepy", _) => assert_eq!(run.attempt, 1, "snoozes use no attempt"),
            ("ok", RunOutcome::Completed) => {}
            other => panic!("unexpected run {other:?}: {run:?}"),
        }
    }
}

/// Five snoozes and a success leave attempt 1; a snoozed job is not claimable before its
/// due time, which is the database's now plus the delay.
fn snoozes_use_no_attempt_and_are_counted(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("sz", "nap", vec![]))
        .unwrap()
        .id;
    let naps: Arc<Mutex<u32>> = Arc::default();
    let counter = naps.clone();
    let report = Worker::builder(pool.clone())
        .queue("sz")
        .raw_handler("nap", move |_: &JobContext, _: &[u8]| {
            let mut naps = counter.lock().unwrap();
            *naps += 1;
            if *naps <= 5 {
                return Err(JobError::snooze(Duration::ZERO));
            }
            Ok(())
        })
        .drain()
        .unwrap();
    assert_eq!((report.snoozed, report.completed), (5, 1), "{report:?}");
    let job = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Completed, 1));
    assert_eq!(job.snoozes, 5);

    // A snooze of an hour: waiting, due an hour after the database's now, not claimable.
    let id = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("sz", "late", vec![]))
        .unwrap()
        .id;
    let report = Worker::builder(pool.clone())
        .queue("sz")
        .raw_handler("late", |_: &JobContext, _: &[u8]| {
            Err(JobError::snooze(Duration::from_secs(3600)))
        })
        .drain()
        .unwrap();
    assert_eq!(report.snoozed, 1, "{report:?}");
    let mut conn = pool.get().unwrap();
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(
        (job.state, job.attempt, job.snoozes),
        (JobState::Waiting, 0, 1)
    );
    let now = tenure::database_now(&mut conn).unwrap();
    assert!(job.due_at - now > chrono::Duration::minutes(59), "{job:?}");
    assert!(
        jobs::claim(&mut conn, "sz", 10, Duration::from_secs(60))
            .unwrap()
            .is_empty()
    );
}

/// With a Prometheus recorder installed (once per process), a drain's runs and enqueues are
/// counted per queue, kind and outcome, and the stats gauges are set.
#[cfg(feature = "metrics")]
fn metrics_count_what_the_worker_did(backend: Backend) {
    use std::sync::OnceLock;
    static HANDLE: OnceLock<metrics_exporter_prometheus::PrometheusHandle> = OnceLock::new();
    let handle = HANDLE.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("install the recorder")
    });
    // A queue of this test's own: other tests in this process count under theirs.
    let queue = format!("metrics-{}", backend.to_string().to_lowercase());
    let db = TestDb::migrated(backend);
    let pool: tenure::Pool = db.pool(2);
    let batch: Vec<NewJob> = (0..4)
        .map(|i| NewJob::json(queue.as_str(), "m", &i).unwrap())
        .collect();
    jobs::enqueue_many(&mut pool.get().unwrap(), &batch).unwrap();
    let report = Worker::builder(pool.clone())
        .queue(queue.as_str())
        .handler("m", |_: &JobContext, i: u32| {
            if i == 3 {
                return Err(JobError::dead("three"));
            }
            Ok(())
        })
        .drain()
        .unwrap();
    assert_eq!((report.completed, report.dead), (3, 1));
    tenure::metrics::record_stats(&jobs::stats(&mut pool.get().unwrap()).unwrap());
    let text = handle.render();
    let value = |name: &str, labels: &str| -> Option<f64> {
        text.lines()
            .find(|line| line.starts_with(&format!("{name}{{{labels}}} ")))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    let q = format!("queue=\"{queue}\"");
    assert_eq!(value("tenure_jobs_enqueued_total", &q), Some(4.0), "{text}");
    assert_eq!(
        value(
            "tenure_job_runs_total",
            &format!("{q},kind=\"m\",outcome=\"completed\"")
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        value(
            "tenure_job_runs_total",
            &format!("{q},kind=\"m\",outcome=\"dead\"")
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value("tenure_job_run_seconds_count", &format!("{q},kind=\"m\"")),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        value("tenure_jobs", &format!("{q},state=\"completed\"")),
        Some(3.0),
        "{text}"
    );
}

/// What a tracing subscriber saw: spans by name with their fields, events by target.
#[derive(Default)]
struct Seen {
    spans: Vec<(String, HashMap<String, String>)>,
    events: Vec<(String, HashMap<String, String>)>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").trim_matches('"').to_string(),
        );
    }
}

struct Recorder(Arc<Mutex<Seen>>);

impl<S> tracing_subscriber::Layer<S> for Recorder
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.0
            .lock()
            .unwrap()
            .spans
            .push((attrs.metadata().name().to_string(), fields));
    }

    fn on_record(
        &self,
        _: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        // The run's result and time, recorded on the newest span at its end.
        let mut seen = self.0.lock().unwrap();
        if let Some((_, fields)) = seen.spans.last_mut() {
            values.record(&mut Fields(fields));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.0
            .lock()
            .unwrap()
            .events
            .push((event.metadata().target().to_string(), fields));
    }
}

/// A drain under a subscriber: one `tenure.job` span per run with its id, kind, attempt,
/// queue wait and (at its end) result and run time; one `tenure::job` event per recorded run
/// with its outcome and error.
fn tracing_has_a_span_per_run_and_a_line_per_recorded_job(backend: Backend) {
    use tracing_subscriber::layer::SubscriberExt;
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let ok = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("tr", "ok", vec![]))
        .unwrap()
        .id;
    let bad = jobs::enqueue(&mut pool.get().unwrap(), &NewJob::new("tr", "bad", vec![]))
        .unwrap()
        .id;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let subscriber = tracing_subscriber::registry().with(Recorder(seen.clone()));
    let report = tracing::subscriber::with_default(subscriber, || {
        Worker::builder(pool.clone())
            .queue("tr")
            .raw_handler("ok", |_: &JobContext, _: &[u8]| Ok(()))
            .raw_handler("bad", |_: &JobContext, _: &[u8]| {
                Err(JobError::dead("broken"))
            })
            .drain()
            .unwrap()
    });
    assert_eq!((report.completed, report.dead), (1, 1));
    let seen = seen.lock().unwrap();
    let span = |id: i64| {
        seen.spans
            .iter()
            .find(|(name, f)| name == "tenure.job" && f.get("job.id") == Some(&id.to_string()))
            .map(|(_, f)| f.clone())
            .unwrap_or_else(|| panic!("no span for job {id}: {:?}", seen.spans))
    };
    let line = |id: i64| {
        let lines: Vec<_> = seen
            .events
            .iter()
            .filter(|(target, f)| {
                target == "tenure::job" && f.get("job.id") == Some(&id.to_string())
            })
            .collect();
        assert_eq!(lines.len(), 1, "one line per recorded run: {lines:?}");
        lines[0].1.clone()
    };
    let (ok_span, bad_span) = (span(ok), span(bad));
    assert_eq!(ok_span["kind"], "ok");
    assert_eq!(ok_span["attempt"], "1");
    assert_eq!(ok_span["result"], "ok");
    assert_eq!(bad_span["result"], "error");
    for fields in [&ok_span, &bad_span] {
        assert!(fields.contains_key("queue_wait_ms") && fields.contains_key("run_ms"));
    }
    let (ok_line, bad_line) = (line(ok), line(bad));
    assert_eq!(ok_line["outcome"], "completed");
    assert_eq!(
        (bad_line["outcome"].as_str(), bad_line["error"].as_str()),
        ("dead", "broken")
    );
    assert_eq!(bad_line["queue"], "tr");
    assert!(ok_line.contains_key("run_ms") && ok_line.contains_key("queue_wait_ms"));
}

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
    let mut last = None;
    poll_until(limit, Duration::from_millis(10), || {
        let job = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
        if job.state == state {
            return Some(job);
        }
        last = Some(job);
        None
    })
    .unwrap_or_else(|| last.expect("one read at least"))
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

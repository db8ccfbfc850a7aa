//! Typed jobs: a type's kind, queue and options applied at enqueue, its handler given the
//! value decoded, a payload of the wrong shape a clear error, and a worker that never claims
//! kinds it has no handler for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tenure::jobs::{self, Backoff, JobArgs, JobState, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Backend, Error};

use crate::common::{TestDb, conformance, poll_until, wait_for};

conformance!(
    a_typed_job_round_trips_with_its_options,
    a_payload_of_another_shape_is_dead_with_a_clear_error,
    a_worker_never_claims_kinds_it_has_no_handler_for,
    eight_workers_of_one_kind_leave_the_other_kind_untouched,
    a_types_backoff_is_its_kinds_retry_policy,
    the_builder_refuses_a_kind_registered_twice,
    a_timeout_too_long_for_an_instant_does_not_stop_the_heartbeat,
    bad_typed_consts_are_typed_errors_and_change_nothing,
);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Invoice {
    customer: u32,
    cents: i64,
}

impl JobArgs for Invoice {
    const KIND: &'static str = "invoice";
    const QUEUE: &'static str = "billing";
    const MAX_ATTEMPTS: u32 = 7;
    const PRIORITY: i32 = -3;
    fn dedup_key(&self) -> Option<String> {
        Some(format!("invoice:{}:{}", self.customer, self.cents))
    }
    fn limit(&self) -> Option<(String, u32)> {
        Some((format!("customer:{}", self.customer), 2))
    }
}

/// Another kind on the same queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    invoice: i64,
}

impl JobArgs for Receipt {
    const KIND: &'static str = "receipt";
    const QUEUE: &'static str = "billing";
}

fn a_typed_job_round_trips_with_its_options(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = pool.get().unwrap();
    let invoice = Invoice {
        customer: 42,
        cents: 1999,
    };
    let first = jobs::enqueue_job(&mut conn, &invoice).unwrap();
    // Its dedup key, derived from the value, folds a second enqueue of the same value.
    let again = jobs::enqueue_job(&mut conn, &invoice).unwrap();
    assert!(again.existing && again.id == first.id, "{again:?}");
    let more = jobs::enqueue_jobs(
        &mut conn,
        &[
            Invoice {
                customer: 7,
                cents: 1,
            },
            Invoice {
                customer: 8,
                cents: 2,
            },
        ],
    )
    .unwrap();
    assert_eq!(more.len(), 2);
    let stored = jobs::get(&mut conn, first.id).unwrap().unwrap();
    assert_eq!(
        (
            stored.queue.as_str(),
            stored.kind.as_str(),
            stored.max_attempts,
            stored.priority
        ),
        ("billing", "invoice", 7, -3)
    );
    assert_eq!(stored.dedup_key.as_deref(), Some("invoice:42:1999"));
    assert_eq!(stored.limit_key.as_deref(), Some("customer:42"));
    assert_eq!(stored.limit_max, Some(2));
    drop(conn);

    let seen: Arc<Mutex<HashMap<i64, (Invoice, JobContext)>>> = Arc::default();
    let record = seen.clone();
    // The worker serves the type's queue without being told.
    let worker = Worker::builder(pool.clone())
        .threads(2)
        .poll_interval(Duration::from_millis(20))
        .register(move |ctx: &JobContext, invoice: Invoice| {
            record
                .lock()
                .unwrap()
                .insert(ctx.id, (invoice, ctx.clone()));
            Ok(())
        })
        .start()
        .unwrap();
    let report = wait_for(&worker, Duration::from_secs(60), |r| r.completed >= 3);
    worker.shutdown(Duration::from_secs(5));
    assert_eq!(report.completed, 3, "{report:?}");
    let seen = seen.lock().unwrap();
    let (value, ctx) = &seen[&first.id];
    assert_eq!(value, &invoice);
    assert_eq!(
        (ctx.queue.as_str(), ctx.kind.as_str()),
        ("billing", "invoice")
    );
    assert_eq!((ctx.attempt, ctx.max_attempts), (1, 7));
    // The context's instants are the row's, by the database's clock.
    let row = jobs::get(&mut pool.get().unwrap(), first.id)
        .unwrap()
        .unwrap();
    assert_eq!(ctx.enqueued_at, row.created_at);
    assert_eq!(Some(ctx.claimed_at), row.claimed_at);
    assert_eq!(ctx.due_at, row.due_at);
    assert!(ctx.enqueued_at <= ctx.due_at && ctx.due_at <= ctx.claimed_at);
    assert_eq!(
        ctx.queue_wait(),
        (ctx.claimed_at - ctx.due_at).to_std().unwrap()
    );
}

fn a_payload_of_another_shape_is_dead_with_a_clear_error(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    // A job of the invoice kind whose payload is not an Invoice (enqueued by hand, or by an
    // older version of the type).
    let id = jobs::enqueue(
        &mut pool.get().unwrap(),
        &NewJob::json("billing", "invoice", &serde_json::json!({"customer": "x"})).unwrap(),
    )
    .unwrap()
    .id;
    let report = Worker::builder(pool.clone())
        .register(|_: &JobContext, _: Invoice| Ok(()))
        .drain()
        .unwrap();
    assert_eq!((report.dead, report.completed, report.retried), (1, 0, 0));
    let job = jobs::get(&mut pool.get().unwrap(), id).unwrap().unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Dead, 1));
    let error = job.last_error.unwrap();
    assert!(
        error.contains("does not decode as") && error.contains("Invoice"),
        "{error}"
    );
    // The test helper says the same, and changes nothing.
    let err = tenure::testing::enqueued::<Invoice, _>(&mut pool.get().unwrap());
    assert!(err.unwrap().is_empty(), "dead jobs are not waiting");
    jobs::enqueue(
        &mut pool.get().unwrap(),
        &NewJob::json("billing", "invoice", &1).unwrap(),
    )
    .unwrap();
    let err = tenure::testing::enqueued::<Invoice, _>(&mut pool.get().unwrap()).unwrap_err();
    assert!(
        matches!(err, Error::InvalidInput { .. }) && err.to_string().contains("Invoice"),
        "{err}"
    );
}

fn a_worker_never_claims_kinds_it_has_no_handler_for(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let mut conn = pool.get().unwrap();
    // Receipts first: ahead of the invoices in the queue's order.
    let receipts: Vec<i64> = (0..20)
        .map(|i| {
            jobs::enqueue(
                &mut conn,
                &Receipt { invoice: i }.to_job().unwrap().priority(-10),
            )
            .unwrap()
            .id
        })
        .collect();
    let invoices: Vec<Invoice> = (0..30)
        .map(|i| Invoice {
            customer: i,
            cents: 1,
        })
        .collect();
    jobs::enqueue_jobs(&mut conn, &invoices).unwrap();
    drop(conn);
    let report = Worker::builder(pool.clone())
        .register(|_: &JobContext, _: Invoice| Ok(()))
        .drain()
        .unwrap();
    assert_eq!(report.completed, 30, "{report:?}");
    let mut conn = pool.get().unwrap();
    for id in receipts {
        let job = jobs::get(&mut conn, id).unwrap().unwrap();
        assert_eq!((job.state, job.attempt), (JobState::Waiting, 0), "{job:?}");
    }
    // They wait for their own workers, and show in the queue's stats.
    let stats = jobs::stats(&mut conn).unwrap();
    let billing = stats.queues.iter().find(|q| q.queue == "billing").unwrap();
    assert_eq!((billing.waiting, billing.completed), (20, 30));
}

/// Eight workers with handlers for invoices only, racing over a queue where receipts and
/// invoices alternate: every invoice runs once, and no receipt is ever claimed.
fn eight_workers_of_one_kind_leave_the_other_kind_untouched(backend: Backend) {
    const INVOICES: usize = 400;
    let db = TestDb::migrated(backend);
    let pool = db.pool(40);
    let mut jobs_in = Vec::new();
    for i in 0..INVOICES {
        jobs_in.push(Receipt { invoice: i as i64 }.to_job().unwrap());
        jobs_in.push(
            Invoice {
                customer: i as u32,
                cents: 1,
            }
            .to_job()
            .unwrap(),
        );
    }
    jobs::enqueue_many(&mut pool.get().unwrap(), &jobs_in).unwrap();
    let runs: Arc<Mutex<HashMap<u32, usize>>> = Arc::default();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let runs = runs.clone();
            Worker::builder(pool.clone())
                .threads(1)
                .prefetch(4)
                .poll_interval(Duration::from_millis(20))
                .register(move |_: &JobContext, invoice: Invoice| {
                    *runs.lock().unwrap().entry(invoice.customer).or_default() += 1;
                    Ok(())
                })
                .start()
                .unwrap()
        })
        .collect();
    poll_until(Duration::from_secs(120), Duration::from_millis(20), || {
        (runs.lock().unwrap().len() >= INVOICES).then_some(())
    });
    let reports: Vec<_> = workers
        .into_iter()
        .map(|w| w.shutdown(Duration::from_secs(10)))
        .collect();
    let runs = runs.lock().unwrap();
    assert_eq!(runs.len(), INVOICES, "every invoice ran");
    assert!(runs.values().all(|&n| n == 1), "an invoice ran twice");
    assert_eq!(reports.iter().map(|r| r.completed).sum::<usize>(), INVOICES);
    let mut conn = pool.get().unwrap();
    let receipts = jobs::list(
        &mut conn,
        &jobs::JobFilter {
            kind: Some("receipt".into()),
            limit: 1000,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(receipts.len(), INVOICES);
    for job in receipts {
        assert_eq!((job.state, job.attempt), (JobState::Waiting, 0), "{job:?}");
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Patient;

impl JobArgs for Patient {
    const KIND: &'static str = "patient";
    const BACKOFF: Option<Backoff> = Some(Backoff {
        base: Duration::from_secs(3600),
        max: Duration::from_secs(7200),
    });
}

fn a_types_backoff_is_its_kinds_retry_policy(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let id = jobs::enqueue_job(&mut pool.get().unwrap(), &Patient)
        .unwrap()
        .id;
    let report = Worker::builder(pool.clone())
        // The worker's default would retry within a second.
        .backoff(Backoff {
            base: Duration::from_millis(1),
            max: Duration::from_millis(1),
        })
        .register(|_: &JobContext, _: Patient| Err(JobError::retry("later")))
        .drain()
        .unwrap();
    assert_eq!(report.retried, 1, "{report:?}");
    let mut conn = pool.get().unwrap();
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Waiting);
    // Jitter keeps at least half of the hour.
    let wait = job.due_at - job.claimed_at.unwrap();
    assert!(wait >= chrono::Duration::minutes(29), "{wait}");
}

fn the_builder_refuses_a_kind_registered_twice(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(8);
    let err = Worker::builder(pool.clone())
        .register(|_: &JobContext, _: Invoice| Ok(()))
        .handler("invoice", |_: &JobContext, _: serde_json::Value| Ok(()))
        .start()
        .err()
        .expect("refused");
    assert!(
        matches!(err, Error::InvalidInput { .. }) && err.to_string().contains("two handlers"),
        "{err}"
    );
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
            let probe = || -> Result<Option<&'static str>, JobError> {
                let job = jobs::get(&mut handler_pool.get()?, ctx.id)?.unwrap();
                if job.lapses > 0 {
                    return Ok(Some("lapsed"));
                }
                let renewed = job
                    .claim_expires_at
                    .is_some_and(|at| at > ctx.claimed_at + ttl);
                Ok(renewed.then_some("renewed"))
            };
            let verdict = poll_until(Duration::from_secs(90), Duration::from_millis(50), || {
                probe().transpose()
            })
            .transpose()?
            .unwrap_or("neither");
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

//! SQLite's write turns (the writers of one process take turns): a write waits its turn or fails
//! retryably in time, a timed-out turn leaves the queue usable, every kind of write takes its
//! turn, a panic lets the next writer in, files and memory databases do not share turns, and
//! many threads of mixed writes never fail. Every wait that could hang runs in a thread of its
//! own and fails after a generous bound.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use tenure::jobs::{self, NewJob};
use tenure::lease::{self};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, Error, SessionSetup};

use crate::common::{TestDb, conformance, count};

conformance!(
    a_write_on_a_second_connection_inside_a_transaction_fails_retryably_in_time,
    a_timed_out_turn_leaves_the_queue_usable,
    schedule_writes_wait_their_turn_like_job_writes,
    job_single_writes_wait_their_turn,
    a_panic_in_a_transaction_closure_lets_the_next_writer_in,
    a_caught_panic_leaves_no_transaction_open_on_the_connection,
    a_caught_panic_does_not_keep_the_write_lock,
    two_files_in_one_process_do_not_share_turns,
    private_and_shared_memory_databases_never_hang,
    many_threads_many_rounds_of_mixed_writes_never_fail,
);

/// A named write through one of tenure's calls.
type WriteOp = Box<dyn Fn(&mut AnyConnection) -> tenure::Result<()> + Send>;

/// What the turn queue says when a writer's turn did not come within its busy timeout.
const TURN_REFUSED: &str = "another connection of this process";

/// Runs `f` on a thread of its own; panics (naming `what`) if it has not returned within
/// `bound`. A panic of `f` is passed on.
fn bounded<T: Send + 'static>(
    what: &str,
    bound: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (sender, receiver) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    match receiver.recv_timeout(bound) {
        Ok(value) => {
            let _ = thread.join();
            value
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the thread neither answered nor panicked"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not return within {bound:?} (hang or leaked lock)")
        }
    }
}

fn job(kind: &str) -> NewJob {
    NewJob::new("q", kind, vec![])
}

fn with_timeout(db: &TestDb, timeout: Duration) -> AnyConnection {
    db.connect_with(&SessionSetup::default().busy_timeout(timeout))
}

fn jobs_of_kind(conn: &mut AnyConnection, kind: &str) -> i64 {
    count(
        conn,
        &format!("SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = '{kind}'"),
    )
}

/// Re-entrancy: inside a tenure transaction on connection A (which holds this process's turn on
/// SQLite), the same thread writes through connection B to the same database. On SQLite B must
/// not wait forever for a turn its own thread holds: it fails within its busy timeout (here
/// 300 ms; bound 30 s) with a retryable "database is locked". Afterwards B writes normally.
/// On the servers the two writes touch different rows: B's enqueue simply succeeds.
fn a_write_on_a_second_connection_inside_a_transaction_fails_retryably_in_time(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut a = db.connect();
    let b = with_timeout(&db, Duration::from_millis(300));
    let b = Arc::new(Mutex::new(b));
    let inner = tenure::transaction(&mut a, |a| {
        jobs::enqueue(a, &job("outer"))?;
        let b1 = b.clone();
        let inner = bounded(
            "enqueue on B inside A's transaction",
            Duration::from_secs(30),
            move || jobs::enqueue(&mut *b1.lock().unwrap(), &job("inner")),
        );
        // A lease take (a bare write transaction) on B, too.
        let b2 = b.clone();
        let take = bounded(
            "lease take on B inside A's transaction",
            Duration::from_secs(30),
            move || {
                lease::try_take(
                    &mut *b2.lock().unwrap(),
                    "reentrant",
                    Duration::from_secs(60),
                    "b",
                )
                .map(|l| l.is_some())
            },
        );
        Ok::<_, Error>((inner.map(|_| ()), take))
    })
    .expect("A's transaction");
    match backend {
        Backend::Sqlite => {
            let err = inner
                .0
                .expect_err("B cannot write while A holds the write lock");
            assert!(err.is_retryable(), "not retryable: {err}");
            let err = inner
                .1
                .expect_err("B cannot take a lease while A holds the write lock");
            assert!(err.is_retryable(), "not retryable: {err}");
        }
        _ => {
            inner.0.expect("B's enqueue on a server");
            assert!(inner.1.expect("B's take on a server"));
        }
    }
    // The turn queue is usable afterwards.
    let mut b = b.lock().unwrap();
    jobs::enqueue(&mut *b, &job("after")).expect("B writes once A committed");
    assert_eq!(jobs_of_kind(&mut b, "outer"), 1);
    assert_eq!(jobs_of_kind(&mut b, "after"), 1);
}

/// A holder keeps the turn; a writer with a short busy timeout gives up (leaving the queue),
/// another with a long one waits. Once the holder commits, the patient writer must get in
/// promptly (bound 30 s, far below its 120 s busy timeout), and a third writer after it too.
fn a_timed_out_turn_leaves_the_queue_usable(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut holder = db.connect();
    let (release, released) = mpsc::channel::<()>();
    let (started, holding) = mpsc::channel::<()>();
    let hold = std::thread::spawn(move || {
        tenure::transaction(&mut holder, |c| {
            jobs::enqueue(c, &job("held"))?;
            started.send(()).unwrap();
            released.recv().unwrap();
            Ok::<_, Error>(())
        })
    });
    holding.recv().unwrap();
    let mut quick = with_timeout(&db, Duration::from_millis(200));
    let quick_result = bounded("the impatient writer", Duration::from_secs(30), move || {
        jobs::enqueue(&mut quick, &job("quick"))
    });
    let mut patient = with_timeout(&db, Duration::from_secs(120));
    let (patient_sender, patient_done) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = patient_sender.send(jobs::enqueue(&mut patient, &job("patient")));
    });
    std::thread::sleep(Duration::from_millis(300));
    release.send(()).unwrap();
    hold.join().unwrap().expect("the holder's transaction");
    let patient_result = patient_done
        .recv_timeout(Duration::from_secs(30))
        .expect("the patient writer got no turn within 30 s of the holder's commit");
    patient_result.expect("the patient writer's enqueue");
    if backend == Backend::Sqlite {
        let err = quick_result.expect_err("the impatient writer found the turn taken");
        assert!(err.is_retryable(), "{err}");
    } else {
        quick_result.expect("servers: no wait");
    }
    let mut third = with_timeout(&db, Duration::from_secs(120));
    bounded("a third writer", Duration::from_secs(30), move || {
        jobs::enqueue(&mut third, &job("third")).expect("third writer");
    });
}

/// Inside a tenure transaction on A (the turn's holder), a write on B (busy timeout 300 ms)
/// says which lock it waited for. Writes that take their turn fail with the turn queue's
/// message; a write that skips the queue fails with SQLite's own busy error, having waited
/// on SQLite's busy handler only, which is what lets it starve behind this process's other
/// writers. The promise is turns around every single write statement tenure makes.
/// SQLite only; on the servers nothing waits and the writes succeed.
fn schedule_writes_wait_their_turn_like_job_writes(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut setup = db.connect();
    let schedule = Schedule::every("s", Duration::from_secs(3600), job("scheduled"));
    schedules::upsert(&mut setup, &schedule).expect("a schedule to change");
    let ops: Vec<(&str, WriteOp)> = vec![
        (
            "schedules::upsert",
            Box::new(move |c| schedules::upsert(c, &schedule)),
        ),
        (
            "schedules::pause",
            Box::new(|c| schedules::pause(c, "s").map(drop)),
        ),
        (
            "schedules::resume",
            Box::new(|c| schedules::resume(c, "s").map(drop)),
        ),
        (
            "schedules::remove",
            Box::new(|c| schedules::remove(c, "gone").map(drop)),
        ),
    ];
    check_turns(&db, backend, ops);
}

/// The same check for the job operations that are single statements (the control: these
/// take their turn).
fn job_single_writes_wait_their_turn(backend: Backend) {
    let db = TestDb::migrated(backend);
    let ops: Vec<(&str, WriteOp)> = vec![
        (
            "jobs::enqueue",
            Box::new(|c| jobs::enqueue(c, &job("x")).map(drop)),
        ),
        (
            "jobs::cancel",
            Box::new(|c| jobs::cancel(c, 424242).map(drop)),
        ),
        (
            "jobs::retry_dead",
            Box::new(|c| jobs::retry_dead(c, 424242).map(drop)),
        ),
        ("jobs::pause", Box::new(|c| jobs::pause(c, "q"))),
        ("jobs::resume", Box::new(|c| jobs::resume(c, "q"))),
        (
            "lease::force_release",
            Box::new(|c| lease::force_release(c, "l").map(drop)),
        ),
    ];
    check_turns(&db, backend, ops);
}

type Op = Box<dyn Fn(&mut AnyConnection) -> tenure::Result<()> + Send>;

fn check_turns(db: &TestDb, backend: Backend, ops: Vec<(&str, Op)>) {
    let mut a = db.connect();
    let b = Arc::new(Mutex::new(with_timeout(db, Duration::from_millis(300))));
    let mut skipped = Vec::new();
    for (name, op) in ops {
        let b = b.clone();
        let outcome = tenure::transaction(&mut a, |a| {
            jobs::enqueue(a, &job("holder"))?;
            Ok::<_, Error>(bounded(name, Duration::from_secs(30), move || {
                op(&mut b.lock().unwrap())
            }))
        })
        .expect("the holder's transaction");
        match backend {
            Backend::Sqlite => match outcome {
                Err(e) if e.to_string().contains(TURN_REFUSED) => {}
                Err(e) => skipped.push(format!("{name}: {e}")),
                Ok(()) => skipped.push(format!(
                    "{name}: wrote while another connection held the write lock"
                )),
            },
            _ => outcome.unwrap_or_else(|e| panic!("{name} on a server: {e}")),
        }
    }
    assert!(
        skipped.is_empty(),
        "these writes did not wait for their turn (they met SQLite's busy handler directly): {skipped:#?}"
    );
}

/// A thread panics inside a tenure transaction on its own connection (dropped while
/// unwinding). The next writer (busy timeout 120 s) must get in within 30 s.
fn a_panic_in_a_transaction_closure_lets_the_next_writer_in(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut doomed = db.connect();
    let panicked = std::thread::spawn(move || {
        let _: Result<(), Error> = tenure::transaction(&mut doomed, |c| {
            jobs::enqueue(c, &job("doomed"))?;
            panic!("a handler bug inside the transaction");
        });
    })
    .join();
    assert!(panicked.is_err());
    let mut next = with_timeout(&db, Duration::from_secs(120));
    bounded(
        "the writer after a panic",
        Duration::from_secs(30),
        move || {
            jobs::enqueue(&mut next, &job("next")).expect("enqueue after the panic");
            assert_eq!(
                jobs_of_kind(&mut next, "doomed"),
                0,
                "the panicked transaction committed"
            );
        },
    );
}

/// A panic inside `tenure::transaction` caught by the caller (`catch_unwind`, as a worker
/// framework or a request handler does), with the connection kept. The turn is released, but
/// is the transaction? A later `tenure::transaction` + enqueue on the same connection returns
/// Ok; the job must then be committed (visible to another connection). If the panicked
/// transaction stayed open, the later "transaction" is only a savepoint inside it and nothing
/// is ever committed.
fn a_caught_panic_leaves_no_transaction_open_on_the_connection(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        let _: Result<(), Error> = tenure::transaction(&mut conn, |c| {
            jobs::enqueue(c, &job("doomed"))?;
            panic!("a handler bug inside the transaction");
        });
    }));
    assert!(caught.is_err());
    let later = tenure::transaction(&mut conn, |c| jobs::enqueue(c, &job("later")));
    let mut other = db.connect();
    let visible = jobs_of_kind(&mut other, "later");
    assert!(later.is_ok(), "the later transaction: {later:?}");
    assert_eq!(
        visible, 1,
        "tenure::transaction returned Ok after a caught panic, but its job is not committed: \
         the panicked transaction is still open on the connection"
    );
}

/// SQLite: after a caught panic (connection kept alive, unused), another writer (busy timeout
/// 120 s) must get in within 30 s. The turn is released on unwind; the write lock of the
/// still-open BEGIN IMMEDIATE is not. On the servers the writes touch different rows.
fn a_caught_panic_does_not_keep_the_write_lock(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        let _: Result<(), Error> = tenure::transaction(&mut conn, |c| {
            jobs::enqueue(c, &job("doomed"))?;
            panic!("a handler bug inside the transaction");
        });
    }));
    assert!(caught.is_err());
    let mut next = with_timeout(&db, Duration::from_secs(120));
    let result = bounded(
        "a writer after a caught panic (connection kept)",
        Duration::from_secs(30),
        move || jobs::enqueue(&mut next, &job("next")).map(drop),
    );
    result.expect("the next writer");
    drop(conn);
}

/// Turns are per file: inside a tenure transaction on file X, a write on file Y (busy timeout
/// 120 s) succeeds at once (bound 30 s). On the servers: two databases, trivially.
fn two_files_in_one_process_do_not_share_turns(backend: Backend) {
    let x = TestDb::migrated(backend);
    let y = TestDb::migrated(backend);
    let mut on_x = x.connect();
    let on_y = Arc::new(Mutex::new(with_timeout(&y, Duration::from_secs(120))));
    tenure::transaction(&mut on_x, |c| {
        jobs::enqueue(c, &job("x"))?;
        let on_y = on_y.clone();
        bounded(
            "a write on another file",
            Duration::from_secs(30),
            move || {
                let mut y = on_y.lock().unwrap();
                jobs::enqueue(&mut *y, &job("y")).expect("enqueue on Y");
                let claimed =
                    jobs::claim(&mut *y, "q", 1, Duration::from_secs(60)).expect("claim on Y");
                jobs::complete(&mut *y, &[claimed[0].claim()]).expect("complete on Y");
            },
        );
        Ok::<_, Error>(())
    })
    .expect("X's transaction");
}

/// `:memory:` connections are private databases: no turns, no waits. A shared-cache
/// in-memory database (`file:NAME?mode=memory&cache=shared`) is one database for several
/// connections: a write on the second while the first is in a tenure transaction must return
/// (Ok, or a retryable error) within 30 s, never hang. SQLite only (servers: trivially).
fn private_and_shared_memory_databases_never_hang(backend: Backend) {
    if backend != Backend::Sqlite {
        return;
    }
    let mut a = AnyConnection::connect(":memory:").unwrap();
    tenure::run_migrations(&mut a).unwrap();
    let b = Arc::new(Mutex::new(AnyConnection::connect(":memory:").unwrap()));
    tenure::transaction(&mut a, |c| {
        jobs::enqueue(c, &job("a"))?;
        let b = b.clone();
        bounded(
            "a private memory database",
            Duration::from_secs(30),
            move || {
                let mut b = b.lock().unwrap();
                tenure::run_migrations(&mut *b).expect("migrations on B");
                jobs::enqueue(&mut *b, &job("b")).expect("enqueue on B");
            },
        );
        Ok::<_, Error>(())
    })
    .unwrap();

    let url = format!(
        "file:attacks3_{}?mode=memory&cache=shared",
        uuid::Uuid::new_v4().simple()
    );
    let mut a = AnyConnection::connect(&url).unwrap();
    tenure::run_migrations(&mut a).unwrap();
    let b = Arc::new(Mutex::new(AnyConnection::connect(&url).unwrap()));
    tenure::transaction(&mut a, |c| {
        jobs::enqueue(c, &job("a"))?;
        let b = b.clone();
        let result = bounded(
            "a shared-cache memory database",
            Duration::from_secs(30),
            move || jobs::enqueue(&mut *b.lock().unwrap(), &job("b")).map(drop),
        );
        if let Err(e) = result {
            assert!(e.is_retryable(), "{e}");
        }
        Ok::<_, Error>(())
    })
    .unwrap();
    jobs::enqueue(&mut *b.lock().unwrap(), &job("b2")).expect("B writes once A committed");
}

/// Six threads, each on its own connection (busy timeout 30 s), 25 rounds of: claim a job,
/// then one tenure transaction that enqueues, cancels what it enqueued, and completes the
/// claim, then a lease take/release and a lone enqueue. No call may fail: with turns no
/// writer waits longer than the writers ahead of it, a few short transactions. Bound 10 min.
fn many_threads_many_rounds_of_mixed_writes_never_fail(backend: Backend) {
    const THREADS: usize = 6;
    const ROUNDS: usize = 25;
    let db = TestDb::migrated(backend);
    let mut seed = db.connect();
    jobs::enqueue_many(&mut seed, &vec![job("seed"); THREADS * ROUNDS]).unwrap();
    let url = db.url().to_string();
    let errors = bounded(
        "the mixed-writes contest",
        Duration::from_secs(600),
        move || {
            let barrier = Arc::new(Barrier::new(THREADS));
            let threads: Vec<_> = (0..THREADS)
                .map(|t| {
                    let mut conn = AnyConnection::connect_raw(&url).unwrap();
                    SessionSetup::default()
                        .busy_timeout(Duration::from_secs(30))
                        .apply(&mut conn)
                        .unwrap();
                    let barrier = barrier.clone();
                    std::thread::spawn(move || {
                        barrier.wait();
                        let mut errors = Vec::new();
                        for round in 0..ROUNDS {
                            let step = (|| -> tenure::Result<()> {
                                let claimed =
                                    jobs::claim(&mut conn, "q", 1, Duration::from_secs(300))?;
                                tenure::transaction(&mut conn, |c| {
                                    let id = jobs::enqueue(c, &job("extra"))?.id;
                                    assert!(jobs::cancel(c, id)?);
                                    if let Some(j) = claimed.first() {
                                        jobs::complete(c, &[j.claim()])?;
                                    }
                                    Ok::<_, Error>(())
                                })?;
                                let name = format!("l{}", round % 3);
                                if let Some(mut l) =
                                    lease::try_take(&mut conn, &name, Duration::from_secs(60), "t")?
                                {
                                    l.release(&mut conn)?;
                                }
                                jobs::enqueue(&mut conn, &job("lone"))?;
                                Ok(())
                            })();
                            if let Err(e) = step {
                                errors.push(format!("thread {t} round {round}: {e}"));
                            }
                        }
                        errors
                    })
                })
                .collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().expect("a contender panicked"))
                .collect::<Vec<_>>()
        },
    );
    assert!(
        errors.is_empty(),
        "{} failed calls: {errors:#?}",
        errors.len()
    );
    assert_eq!(jobs_of_kind(&mut seed, "lone"), (THREADS * ROUNDS) as i64);
}

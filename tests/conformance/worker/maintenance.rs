//! A worker's maintenance thread fires schedules, rescues lapsed claims, ages priorities,
//! prunes and turns what needs turning, one pass after another. A pass that went on while its
//! batches were full held the thread for as long as a backlog lasted: a finisher faster than
//! the prune, forty policies with ten thousand jobs each, a hundred thousand jobs to age. A pass
//! now makes a bounded number of calls over all its policies or queues and leaves the rest to
//! the next, after the other passes that are due; the next starts with the policy or queue
//! after the one it stopped at.
//!
//! The bounds below are wide: a gap between beats of a schedule of every second is asked to
//! stay under 3 s, or under half the time the beats were watched where that is longer (a busy
//! machine is slower at both; the watch ends with the backlog, or after 12 s), and with the
//! pass that held the thread it was the whole time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tenure::jobs::{self, AGED_PRIORITY, Finished, JobState, NewJob, Retention};
use tenure::schedules::{self, Schedule};
use tenure::worker::{Worker, WorkerBuilder};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count};
use crate::queue_ops::retention::{finished_jobs, keep_fed};

conformance!(
    schedules_fire_while_a_steady_finisher_feeds_the_prune,
    schedules_fire_and_lapsed_claims_are_rescued_while_many_policies_have_a_backlog,
    schedules_fire_while_the_aging_pass_has_a_backlog,
);

/// A schedule of every second, enqueuing into queue `beat`.
fn beat_every_second(conn: &mut AnyConnection) {
    let job = NewJob::new("beat", "k", vec![]);
    schedules::upsert(conn, &Schedule::every("beat", Duration::from_secs(1), job)).unwrap();
}

fn beats(conn: &mut AnyConnection) -> i64 {
    count(
        conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'beat'",
    )
}

/// A worker of one thread on `queue` that runs schedules.
fn scheduling_worker(db: &TestDb, queue: &str) -> WorkerBuilder {
    Worker::builder(db.pool(4))
        .queue(queue)
        .threads(1)
        .run_schedules()
        .raw_handler("k", |_, _: &[u8]| Ok(()))
}

/// The longest time between two beats seen so far, read every 50 ms.
struct Gaps {
    last: i64,
    last_at: Instant,
    longest: Duration,
}

impl Gaps {
    fn new(conn: &mut AnyConnection) -> Self {
        Gaps {
            last: beats(conn),
            last_at: Instant::now(),
            longest: Duration::ZERO,
        }
    }

    fn look(&mut self, conn: &mut AnyConnection) {
        std::thread::sleep(Duration::from_millis(50));
        let now = beats(conn);
        if now != self.last {
            (self.last, self.last_at) = (now, Instant::now());
        }
        self.longest = self.longest.max(self.last_at.elapsed());
    }
}

/// How long a test watches the beats at most while the backlog is worked off (it stops
/// sooner once the backlog is gone). A pass that held the thread held it for all of that.
const WATCH: Duration = Duration::from_secs(12);

/// The bound a wait is held to when the beats were watched for `watched`: 3 s, or half of
/// `watched`. A pass that held the thread made it all of `watched` (the backlog outlasted the
/// watch) or all of the backlog's time (the watch ended with it).
fn allowed(watched: Duration) -> Duration {
    Duration::from_secs(3).max(watched / 2)
}

/// A finisher faster than the prune keeps every batch full: the pass that went on while they
/// were full never ended, and a schedule of every second fired 0 times in 30 s (PostgreSQL
/// and MariaDB; SQLite's one writer ends each pass: it cannot fail there).
fn schedules_fire_while_a_steady_finisher_feeds_the_prune(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    beat_every_second(&mut conn);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let producer = s.spawn(|| keep_fed(&db, &stop));
        std::thread::sleep(Duration::from_millis(300));
        let worker = scheduling_worker(&db, "beat")
            .retention("fed", Finished::Completed, Retention::DeleteAll)
            .start()
            .unwrap();
        // Well into the first pass (the first tick may fire before it starts).
        std::thread::sleep(Duration::from_secs(2));
        let before = beats(&mut conn);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut after = before;
        while after <= before + 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            after = beats(&mut conn);
        }
        stop.store(true, Ordering::Relaxed);
        let inserted = producer.join().unwrap();
        worker.shutdown(Duration::from_secs(10));
        assert!(
            after > before + 1,
            "a schedule of every second fired {} times in 30 s while a steady finisher \
             ({inserted} jobs) fed the worker's prune",
            after - before
        );
    });
}

/// Forty policies, each with 10,000 completed jobs to delete. With ten calls a policy in a
/// pass, one pass was all of them: no beat for 5.4 s on PostgreSQL, 7.6 s on SQLite, 11.0 s
/// on MariaDB, and a claim that lapsed meanwhile was rescued 4.5 to 10.1 s after its lapse by
/// a worker that rescues every second.
fn schedules_fire_and_lapsed_claims_are_rescued_while_many_policies_have_a_backlog(
    backend: Backend,
) {
    const POLICIES: usize = 40;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let queues: Vec<String> = (0..POLICIES).map(|i| format!("bk{i}")).collect();
    for queue in &queues {
        finished_jobs(&mut conn, queue, 10_000);
    }
    beat_every_second(&mut conn);
    let left = |conn: &mut AnyConnection| {
        count(
            conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue LIKE 'bk%'",
        )
    };
    // A claim ttl of 2 s: lapsed claims are looked for each second.
    let mut builder = scheduling_worker(&db, "beat").claim_ttl(Duration::from_secs(2));
    for queue in &queues {
        builder = builder.retention(queue.clone(), Finished::Completed, Retention::DeleteAll);
    }
    let start = Instant::now();
    let worker = builder.start().unwrap();
    let mut gaps = Gaps::new(&mut conn);
    // Into the first pass, a claim of 500 ms taken by no worker.
    std::thread::sleep(Duration::from_millis(500));
    let stray = jobs::enqueue(&mut conn, &NewJob::new("stray", "k", vec![]))
        .unwrap()
        .id;
    assert_eq!(
        jobs::claim(&mut conn, "stray", 1, Duration::from_millis(500))
            .unwrap()
            .len(),
        1
    );
    let lapsed_at = Instant::now() + Duration::from_millis(500);
    let mut rescued_after = None;
    // Until the backlog is gone or the watch is over, and the claim rescued (or 60 s).
    while ((left(&mut conn) > 0 && start.elapsed() < WATCH) || rescued_after.is_none())
        && start.elapsed() < Duration::from_secs(60)
    {
        gaps.look(&mut conn);
        if rescued_after.is_none()
            && jobs::get(&mut conn, stray).unwrap().unwrap().state != JobState::Running
        {
            rescued_after = Some(Instant::now().saturating_duration_since(lapsed_at));
        }
    }
    let whole = start.elapsed();
    let remaining = left(&mut conn);
    worker.shutdown(Duration::from_secs(10));
    println!(
        "{backend}: watched {whole:?}, {remaining} of the backlogs left, longest gap {:?}, rescued {rescued_after:?} after the lapse",
        gaps.longest
    );
    assert!(
        gaps.longest < allowed(whole),
        "a schedule of every second did not fire for {:?} while {POLICIES} policies' backlogs were \
         pruned (in {whole:?})",
        gaps.longest
    );
    let rescued_after = rescued_after.expect("the lapsed claim was never rescued");
    assert!(
        rescued_after < allowed(whole),
        "a claim was rescued {rescued_after:?} after it lapsed, by a worker rescuing every \
         second, while {POLICIES} policies' backlogs were pruned (in {whole:?})"
    );
}

/// A hundred thousand waiting jobs due for aging: an aging pass went on while each call read a
/// full batch, and no beat came for the whole of it (15.4 s on PostgreSQL, 4.7 s on MariaDB;
/// SQLite ages them in 1.5 s, within the bound: it cannot fail there).
fn schedules_fire_while_the_aging_pass_has_a_backlog(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..1000)
        .map(|_| NewJob::new("aging", "slow", vec![]).priority(10))
        .collect();
    for _ in 0..100 {
        jobs::enqueue_many(&mut conn, &batch).unwrap();
    }
    beat_every_second(&mut conn);
    let unaged = |conn: &mut AnyConnection| {
        count(
            conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE queue = 'aging' \
                 AND state = 'waiting' AND priority <> {AGED_PRIORITY}"
            ),
        )
    };
    // Older than the age before the worker starts.
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let worker = Worker::builder(db.pool(4))
        .queue("aging")
        .threads(1)
        .run_schedules()
        .age_priorities(Duration::from_millis(10))
        .raw_handler("slow", |_, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        })
        .start()
        .unwrap();
    let mut gaps = Gaps::new(&mut conn);
    while unaged(&mut conn) > 0 && start.elapsed() < WATCH {
        gaps.look(&mut conn);
    }
    let whole = start.elapsed();
    let remaining = unaged(&mut conn);
    worker.shutdown(Duration::from_secs(10));
    println!(
        "{backend}: watched {whole:?}, {remaining} of 100,000 left to age, longest gap {:?}",
        gaps.longest
    );
    assert!(
        gaps.longest < allowed(whole),
        "a schedule of every second did not fire for {:?} while the aging pass had 100,000 \
         jobs to age (in {whole:?})",
        gaps.longest
    );
}

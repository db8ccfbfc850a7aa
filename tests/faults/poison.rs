//! A job that crashes its worker process every time it runs (a poison job) ends dead after
//! `jobs::MAX_LAPSES` crashes, and takes no other job down with it: not the jobs its worker
//! claimed ahead (they never started), nor those that ran beside it.

use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::child::{now_text, spawn, sql};
use crate::common::{TestDb, conformance, count, poll_until};

conformance!(
    a_poison_job_dies_alone,
    a_claim_outside_a_worker_that_crashes_charges_only_the_job_it_was_running,
    suspects_waiting_their_turn_leave_the_workers_other_threads_to_fresh_jobs,
);

/// Short runs before the poison job, so that its worker times its runs and claims ahead.
const WARM_UP: usize = 200;
/// Jobs behind the poison job: claimed ahead with it, again after every crash.
const BEHIND: usize = 60;

/// A worker process of this scenario: 2 threads, claim ttl 60 s (a crash's jobs come back
/// because its lock ends with it, not by the ttl), prefetch up to 50. Kind `poison` aborts
/// the process; kind `work` records its start (job id, pid) and sleeps 2 ms. Runs until it
/// aborts or is killed.
pub fn poison_worker(url: &str) {
    let pool = Pool::options().max_size(8).open(url).expect("pool");
    let starts = pool.clone();
    let pid = std::process::id() as i64;
    let _worker = Worker::builder(pool)
        .queue("poison")
        .threads(2)
        .prefetch(50)
        .claim_ttl(Duration::from_secs(60))
        .poll_interval(Duration::from_millis(20))
        .raw_handler(
            "poison",
            |_: &JobContext, _: &[u8]| -> Result<(), tenure::worker::JobError> {
                std::process::abort()
            },
        )
        .raw_handler("work", move |ctx: &JobContext, _: &[u8]| {
            crate::recovery::record_start(&mut *starts.get()?, ctx.id, pid)?;
            std::thread::sleep(Duration::from_millis(2));
            Ok(())
        })
        .start()
        .expect("start the worker");
    println!("TENURE started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Warm-up jobs, one poison job, then jobs behind it, one attempt each; a worker process is
/// started again each time the poison job aborts it (a supervisor restarting a crashed
/// service). The poison job ends dead after exactly `MAX_LAPSES` crashes; every other job
/// completes, none with more than one lapse counted. Found by issue 32's review: the jobs
/// claimed ahead with the poison job were rescued with it, due at the same instant and next
/// by id, so they were claimed ahead with it again after every crash, reached 5 lapses with
/// it and ended dead without ever running.
fn a_poison_job_dies_alone(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    crate::recovery::create_fault_starts(&mut conn, backend);
    let work = || NewJob::new("poison", "work", vec![]).max_attempts(1);
    let batch: Vec<NewJob> = (0..WARM_UP)
        .map(|_| work())
        .chain(std::iter::once(
            NewJob::new("poison", "poison", vec![]).max_attempts(1),
        ))
        .chain((0..BEHIND).map(|_| work()))
        .collect();
    let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
    let poison = ids[WARM_UP].id;
    let mut crashes = 0;
    // Each crash's jobs come back within seconds (its lock ends with it); a wide bound.
    let until = Instant::now() + Duration::from_secs(240);
    loop {
        let mut worker = spawn("poison-worker", &[db.url()]);
        assert_eq!(worker.next_report().as_deref(), Some("started"));
        // Until the worker crashes or the jobs are done.
        let mut left = 0;
        poll_until(
            until.saturating_duration_since(Instant::now()),
            Duration::from_millis(50),
            || {
                if let Ok(Some(_)) = worker.child.try_wait() {
                    crashes += 1;
                    return Some(());
                }
                left = count(
                    &mut conn,
                    "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
                );
                (left == 0).then_some(())
            },
        )
        .unwrap_or_else(|| panic!("{left} jobs still to run after {crashes} crashes"));
        if count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
        ) == 0
        {
            break;
        }
        assert!(
            crashes <= 2 * jobs::MAX_LAPSES as usize,
            "{crashes} crashes and not done"
        );
    }
    let dead: Vec<i64> = dead_ids(&mut conn);
    let never_ran = never_ran(&mut conn, dead.iter().filter(|id| **id != poison));
    assert_eq!(
        dead,
        vec![poison],
        "{crashes} crashes; {} dead jobs, of which {never_ran} never ran",
        dead.len()
    );
    let job = jobs::get(&mut conn, poison)
        .unwrap()
        .expect("the poison job");
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.lapses, jobs::MAX_LAPSES);
    assert_eq!(
        crashes,
        jobs::MAX_LAPSES as usize,
        "crashes until the poison job died"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'completed'"
        ),
        (WARM_UP + BEHIND) as i64
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE lapses > 1 AND kind = 'work'"
        ),
        0,
        "a job that ran beside the poison job was charged its crashes"
    );
    println!(
        "{backend}: the poison job died alone after {crashes} crashes; {} jobs completed",
        WARM_UP + BEHIND
    );
}

/// How many of `ids` never recorded a start.
fn never_ran<'a>(conn: &mut AnyConnection, ids: impl Iterator<Item = &'a i64>) -> usize {
    ids.filter(|id| {
        count(
            conn,
            &format!("SELECT COUNT(*) AS n FROM fault_starts WHERE job_id = {id}"),
        ) == 0
    })
    .count()
}

fn dead_ids(conn: &mut AnyConnection) -> Vec<i64> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    diesel::sql_query("SELECT id FROM tenure_jobs WHERE state = 'dead' ORDER BY id")
        .load::<Id>(conn)
        .unwrap()
        .into_iter()
        .map(|row| row.id)
        .collect()
}

/// A process claims 10 jobs outside a worker one at a time (`jobs::claim`, ttl 1 s) and
/// runs each; the second is a poison job that aborts it. The process is started again after
/// each crash, once a rescue has returned the lapsed claim. The poison job dies alone after
/// MAX_LAPSES crashes; the jobs behind it run. (The attack claimed all 10 at once: a claim
/// outside a worker is the start of every job it takes, so the 8 never run were charged
/// every crash; the guide says so, and tells such callers to claim one at a time.)
fn a_claim_outside_a_worker_that_crashes_charges_only_the_job_it_was_running(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    crate::recovery::create_fault_starts(&mut conn, backend);
    let batch: Vec<NewJob> = (0..10)
        .map(|i| NewJob::new("poison", if i == 1 { "poison" } else { "work" }, vec![]))
        .collect();
    let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
    let poison = ids[1].id;
    let until = Instant::now() + Duration::from_secs(120);
    let mut crashes = 0;
    while count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
    ) > 0
    {
        assert!(
            crashes <= 2 * jobs::MAX_LAPSES,
            "{crashes} crashes and not done"
        );
        let mut child = spawn("claim-and-run", &[db.url()]);
        let status = child.child.wait().unwrap();
        if !status.success() {
            crashes += 1;
        }
        // Its claims lapse after 1 s; a rescue returns them.
        while count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running'",
        ) > 0
        {
            assert!(Instant::now() < until, "the crashed claims never came back");
            std::thread::sleep(Duration::from_millis(100));
            jobs::rescue(&mut conn, 100).unwrap();
        }
    }
    let dead = dead_ids(&mut conn);
    let never_ran = never_ran(&mut conn, dead.iter());
    assert_eq!(
        dead,
        vec![poison],
        "{crashes} crashes; {} dead jobs, of which {never_ran} never ran (the poison job \
         aborts before it records a start)",
        dead.len()
    );
}

/// A process claiming outside a worker: claims the jobs of `poison` one at a time for 1 s
/// and runs each: `poison` aborts it; `work` records its start and completes. Exits when
/// nothing is due.
pub fn claim_and_run(url: &str) {
    let pool = Pool::options().max_size(1).open(url).expect("pool");
    let backend = pool.backend();
    let mut conn = AnyConnection::connect(url).expect("connect");
    // One at a time, as the guide tells a caller outside a worker: a claim records the start
    // of every job it takes (tenure cannot tell which of them its caller began).
    while let Some(job) = jobs::claim(&mut conn, "poison", 1, Duration::from_secs(1))
        .expect("claim")
        .pop()
    {
        if job.kind == "poison" {
            std::process::abort();
        }
        let at = now_text(&mut conn, backend).expect("now");
        diesel::sql_query(sql(
            backend,
            "INSERT INTO fault_starts (job_id, pid, at) VALUES (?, ?, ?)",
        ))
        .bind::<BigInt, _>(job.id)
        .bind::<BigInt, _>(std::process::id() as i64)
        .bind::<Text, _>(at)
        .execute(&mut conn)
        .expect("record the start");
        jobs::complete(&mut conn, &[job.claim()]).expect("complete");
    }
    println!("TENURE done");
}

/// Four suspects (jobs whose claims lapsed once: claimed for 1 ms and rescued), each held
/// running until the test lets it go, and 20 fresh 1 ms jobs behind them, on a 4-thread
/// worker. Suspects run one at a time; the other three threads are free, and the fresh jobs
/// all run while the first suspect does. Found by the attack: the suspects waiting their turn
/// count as claimed ahead of free threads (`in_hand = active + queued` in the claimer), so
/// the worker claims nothing more while they wait: the fresh jobs wait for the suspects,
/// three threads idle. Then a shutdown while suspects wait: every job comes back unrun or
/// ran once (none lost, none run twice).
fn suspects_waiting_their_turn_leave_the_workers_other_threads_to_fresh_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let suspects: Vec<i64> = (0..4)
        .map(|_| {
            jobs::enqueue(&mut conn, &NewJob::new("s", "slow", vec![]))
                .unwrap()
                .id
        })
        .collect();
    assert_eq!(
        jobs::claim(&mut conn, "s", 10, Duration::from_millis(1))
            .unwrap()
            .len(),
        4
    );
    std::thread::sleep(Duration::from_millis(50));
    let mut back = 0;
    while back < 4 {
        back += jobs::rescue(&mut conn, 100).unwrap().requeued.len();
    }
    for id in &suspects {
        assert_eq!(jobs::get(&mut conn, *id).unwrap().unwrap().lapses, 1);
    }
    let fresh: Vec<NewJob> = (0..20)
        .map(|_| NewJob::new("s", "quick", vec![]).priority(1))
        .collect();
    jobs::enqueue_many(&mut conn, &fresh).unwrap();
    let runs: std::sync::Arc<std::sync::Mutex<Vec<i64>>> = Default::default();
    let (slow_runs, quick_runs) = (runs.clone(), runs.clone());
    let release = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = release.clone();
    let pool = db.pool(8);
    let worker = Worker::builder(pool)
        .queue("s")
        .threads(4)
        .poll_interval(Duration::from_millis(20))
        .raw_handler("slow", move |ctx: &JobContext, _: &[u8]| {
            slow_runs.lock().unwrap().push(ctx.id);
            // Until the test has seen what it waits for (a wide bound otherwise).
            poll_until(Duration::from_secs(60), Duration::from_millis(10), || {
                held.load(std::sync::atomic::Ordering::SeqCst).then_some(())
            });
            Ok::<(), tenure::worker::JobError>(())
        })
        .raw_handler("quick", move |ctx: &JobContext, _: &[u8]| {
            quick_runs.lock().unwrap().push(ctx.id);
            std::thread::sleep(Duration::from_millis(1));
            Ok::<(), tenure::worker::JobError>(())
        })
        .start()
        .unwrap();
    // While the first suspect runs (held until then), the fresh jobs run on the free threads.
    let quick =
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = 'quick' AND state = 'completed'";
    let mut quick_done = 0;
    poll_until(Duration::from_secs(30), Duration::from_millis(20), || {
        quick_done = count(&mut conn, quick);
        (quick_done >= 20).then_some(())
    });
    let suspects_done = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = 'slow' AND state = 'completed'",
    );
    release.store(true, std::sync::atomic::Ordering::SeqCst);
    let report = worker.shutdown(Duration::from_secs(5));
    let ran = runs.lock().unwrap().clone();
    let mut twice: Vec<i64> = ran.clone();
    twice.sort_unstable();
    twice.dedup();
    assert_eq!(twice.len(), ran.len(), "a job ran twice: {ran:?}");
    let lost = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running'",
    );
    assert_eq!(lost, 0, "jobs left running after the shutdown ({report:?})");
    assert_eq!(
        (quick_done, suspects_done),
        (20, 0),
        "while the first suspect ran on a 4-thread worker (3 threads free), {quick_done} of 20 \
         fresh 1 ms jobs ran"
    );
}

//! H: crash recovery. A worker process (this harness run again with [`VICTIM_FLAG`]; 4
//! threads, prefetch 100, the default claim ttl) holds 4 slow jobs running and the jobs it
//! claimed ahead of them; it is SIGKILLed and a new worker (in this process) starts at once.
//! Figures: per held job, the time from the kill until it started again (p50, p95), and
//! after the table the time until every one of them had (and how many it held).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::support::{BenchDb, Figures, with_latencies};

/// The hidden first argument that makes this process H's worker.
pub const VICTIM_FLAG: &str = "--recovery-victim";

/// Jobs run first (so that the worker's average run is short and it claims its full
/// prefetch), the slow jobs that hold its 4 threads, and the jobs behind them.
const WARM_UP: usize = 300;
const SLOW: usize = 4;
const TAIL: usize = 96;

/// Per run: the backend, the jobs the killed worker held, and when the last ran again.
static EVERY_ONE: Mutex<Vec<(Backend, usize, Duration)>> = Mutex::new(Vec::new());

/// Runs H's worker if this process was started as one (never returns then).
pub fn run_victim_if_asked() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some(VICTIM_FLAG) {
        return;
    }
    let url = args.next().expect("the database URL");
    let pool = Pool::options().max_size(8).open(&url).expect("pool");
    let _worker = Worker::builder(pool)
        .queue("recovery")
        .threads(4)
        .prefetch(100)
        .raw_handler("job", |_: &JobContext, payload: &[u8]| {
            if payload == b"slow" {
                std::thread::sleep(Duration::from_secs(3600));
            }
            Ok::<(), JobError>(())
        })
        .start()
        .expect("start the worker");
    println!("started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Kills the worker process when dropped (also when a run fails half-way).
struct Victim(Child);

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn count(conn: &mut AnyConnection, sql: &str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::RunQueryDsl::get_result::<N>(diesel::sql_query(sql), conn)
        .expect("count")
        .n
}

/// One run of H on `backend`.
pub fn crash_recovery(backend: Backend) -> Figures {
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let job = |payload: &str| NewJob::new("recovery", "job", payload.as_bytes().to_vec());
    let batch: Vec<NewJob> = (0..WARM_UP)
        .map(|_| job("fast"))
        .chain((0..SLOW).map(|_| job("slow")))
        .chain((0..TAIL).map(|_| job("fast")))
        .collect();
    jobs::enqueue_many(&mut conn, &batch).expect("enqueue");
    let mut child = Command::new(std::env::current_exe().expect("this harness"))
        .args([VICTIM_FLAG, db.url()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the worker process");
    let stdout = child.stdout.take().expect("its stdout");
    let mut victim = Victim(child);
    let mut first = String::new();
    BufReader::new(stdout)
        .read_line(&mut first)
        .expect("its first line");
    assert_eq!(first.trim(), "started");
    // It holds what it will hold once its threads are on the slow jobs and its claims ahead
    // stop changing.
    let until = Instant::now() + Duration::from_secs(60);
    let mut last = (0, Instant::now());
    loop {
        let running = count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'running'",
        );
        if running != last.0 {
            last = (running, Instant::now());
        }
        if running > SLOW as i64 && last.1.elapsed() > Duration::from_secs(1) {
            break;
        }
        assert!(Instant::now() < until, "the worker never settled");
        std::thread::sleep(Duration::from_millis(20));
    }
    #[derive(diesel::QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    let held: HashSet<i64> = diesel::RunQueryDsl::load::<Id>(
        diesel::sql_query("SELECT id FROM tenure_jobs WHERE state = 'running'"),
        &mut conn,
    )
    .expect("the held jobs")
    .into_iter()
    .map(|row| row.id)
    .collect();
    let _ = victim.0.kill(); // SIGKILL
    let _ = victim.0.wait();
    let killed = Instant::now();
    let started: Arc<Mutex<HashMap<i64, Instant>>> = Arc::default();
    let seen = started.clone();
    let worker = Worker::builder(db.pool(8))
        .queue("recovery")
        .threads(4)
        .raw_handler("job", move |ctx: &JobContext, _: &[u8]| {
            seen.lock()
                .expect("lock")
                .entry(ctx.id)
                .or_insert_with(Instant::now);
            Ok::<(), JobError>(())
        })
        .start()
        .expect("start the new worker");
    let until = killed + Duration::from_secs(300);
    let latencies: Vec<Duration> = loop {
        let starts = started.lock().expect("lock").clone();
        if held.iter().all(|id| starts.contains_key(id)) {
            break held.iter().map(|id| starts[id] - killed).collect();
        }
        assert!(
            Instant::now() < until,
            "the killed worker's jobs did not run again"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    worker.shutdown(Duration::from_secs(5));
    let last = latencies.iter().max().copied().unwrap_or_default();
    EVERY_ONE
        .lock()
        .expect("lock")
        .push((backend, held.len(), last));
    with_latencies(0.0, latencies)
}

/// After the table: when every held job had run again, per run.
pub fn print_summary() {
    for (backend, held, last) in EVERY_ONE.lock().expect("lock").iter() {
        println!(
            "H on {backend:?}: a killed worker held {held} jobs ({SLOW} running, {} claimed \
             ahead); every one had started again {:.2} s after the kill",
            held - SLOW,
            last.as_secs_f64()
        );
    }
}

//! A job that crashes its worker process every time it runs (a poison job) ends dead after
//! `jobs::MAX_LAPSES` crashes, and takes no other job down with it: not the jobs its worker
//! claimed ahead (they never started), nor those that ran beside it.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, JobState, NewJob};
use tenure::worker::{JobContext, Worker};
use tenure::{AnyConnection, Backend, Pool};

use crate::child::{now_text, spawn, sql};
use crate::common::{TestDb, conformance, count};

conformance!(a_poison_job_dies_alone);

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
            let backend = starts.backend();
            let mut conn = starts.get()?;
            let at = now_text(&mut conn, backend)?;
            diesel::sql_query(sql(
                backend,
                "INSERT INTO fault_starts (job_id, pid, at) VALUES (?, ?, ?)",
            ))
            .bind::<BigInt, _>(ctx.id)
            .bind::<BigInt, _>(pid)
            .bind::<Text, _>(at)
            .execute(&mut *conn)?;
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
    let text = if backend == Backend::Mysql {
        "VARCHAR(64)"
    } else {
        "TEXT"
    };
    conn.batch_execute(&format!(
        "CREATE TABLE fault_starts (job_id BIGINT NOT NULL, pid BIGINT NOT NULL, at {text} NOT NULL)"
    ))
    .unwrap();
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
        loop {
            if let Ok(Some(_)) = worker.child.try_wait() {
                crashes += 1;
                break;
            }
            let left = count(
                &mut conn,
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state IN ('waiting', 'running')",
            );
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < until,
                "{left} jobs still to run after {crashes} crashes"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
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
    let never_ran = dead
        .iter()
        .filter(|id| **id != poison)
        .filter(|id| {
            count(
                &mut conn,
                &format!("SELECT COUNT(*) AS n FROM fault_starts WHERE job_id = {id}"),
            ) == 0
        })
        .count();
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

//! The child processes of the process-level scenarios: this test binary, run again with
//! `TENURE_FAULT_ROLE` set and the filter `child::role`. Without the variable the test does
//! nothing. Children report on stdout in lines starting with `TENURE `.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs;
use tenure::lease::Wait;
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{LeaseGuard, Pool};

/// A child process and its report lines.
pub struct Spawned {
    pub child: Child,
    pub lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl Spawned {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The next report line (without the `TENURE ` prefix), or None when the child's output
    /// ended.
    pub fn next_report(&mut self) -> Option<String> {
        for line in self.lines.by_ref() {
            let line = line.ok()?;
            // libtest may print "test child::role ... " before the first report.
            if let Some(at) = line.find("TENURE ") {
                return Some(line[at + "TENURE ".len()..].to_string());
            }
        }
        None
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {}", self.pid());
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts this test binary as a child in `role` with `args`.
pub fn spawn(role: &str, args: &[&str]) -> Spawned {
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["child::role", "--exact", "--nocapture", "--test-threads=1"])
        .env("TENURE_FAULT_ROLE", role)
        .env("TENURE_FAULT_ARGS", args.join("\u{1f}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a child process");
    let stdout = child.stdout.take().expect("the child's stdout");
    Spawned {
        child,
        lines: BufReader::new(stdout).lines(),
    }
}

pub fn report(line: impl std::fmt::Display) {
    println!("TENURE {line}");
}

#[test]
fn role() {
    let Ok(role) = std::env::var("TENURE_FAULT_ROLE") else {
        return;
    };
    let args: Vec<String> = std::env::var("TENURE_FAULT_ARGS")
        .unwrap_or_default()
        .split('\u{1f}')
        .map(str::to_string)
        .collect();
    match role.as_str() {
        "worker" => worker(&args[0]),
        "capped-worker" => capped_worker(&args[0]),
        "holder" => holder(&args[0]),
        "candidate" => crate::leaders::candidate(&args[0]),
        "pooled-holder" => crate::takeover::pooled_holder(&args[0], &args[1], &args[2]),
        "pooled-holder-n" => {
            crate::takeover::pooled_holder_of(&args[0], &args[1], &args[2], &args[3])
        }
        "pooled-holder-in" => {
            crate::takeover_edges::pooled_holder_in(&args[0], &args[1], &args[2], &args[3])
        }
        "release-on-exit" => crate::takeover_edges::release_on_exit(&args[0], &args[1]),
        "counter" => counter(&args[0], args[1].parse().expect("iterations")),
        "sqlite-load" => sqlite_load(&args[0], args[1].parse().expect("operations")),
        "sqlite-stuck-writer" => sqlite_stuck_writer(&args[0]),
        "poison-worker" => crate::poison::poison_worker(&args[0]),
        "parking-worker" => crate::parked::parking_worker(&args[0]),
        "park-and-hang-worker" => crate::parked::park_and_hang_worker(&args[0]),
        "claim-and-run" => crate::poison::claim_and_run(&args[0]),
        "step-worker" => crate::steps::step_worker(&args[0], &args[1], &args[2]),
        "sequence-worker" => {
            crate::sequences::sequence_worker(&args[0], args[1].parse().expect("threads"))
        }
        "holding-worker" => {
            crate::recovery::holding_worker(&args[0], args[1].parse().expect("cap"))
        }
        other => panic!("unknown role {other}"),
    }
}

/// A worker process of the killed-workers scenario: 4 threads, 10-50 ms handlers, each
/// writing an effect row (job id, claim token, attempt, pid). Even job ids write the effect
/// and the completion in one transaction; odd ones write the effect, then return (the
/// worker's finisher completes them). Runs until killed.
fn worker(url: &str) {
    let pool = Pool::options().max_size(10).open(url).expect("pool");
    let effects = pool.clone();
    let pid = std::process::id() as i64;
    let worker = Worker::builder(pool)
        .queue("chaos")
        .threads(4)
        // Long enough that heartbeats keep every live claim on a loaded machine (on SQLite,
        // 4 processes' writers wait on one file lock, and with builds writing beside them a
        // heartbeat once came more than 3 s late: a live worker's job ran twice). A kill's
        // claims come back sooner: its liveness lock ends with the process.
        .claim_ttl(Duration::from_secs(10))
        .poll_interval(Duration::from_millis(50))
        .raw_handler("effect", move |ctx: &JobContext, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(10 + (ctx.id as u64 * 7919) % 41));
            let backend = effects.backend();
            let insert = |conn: &mut tenure::PooledConnection| -> Result<(), tenure::Error> {
                diesel::sql_query(sql(
                    backend,
                    "INSERT INTO fault_effects (job_id, token, attempt, pid) VALUES (?, ?, ?, ?)",
                ))
                .bind::<BigInt, _>(ctx.id)
                .bind::<Text, _>(ctx.claim().token.to_string())
                .bind::<BigInt, _>(ctx.attempt as i64)
                .bind::<BigInt, _>(pid)
                .execute(&mut **conn)?;
                Ok(())
            };
            // Each job has one attempt: a busy database (SQLite's lock, a full pool, on a
            // loaded machine) is waited out here rather than failing the job for good.
            let mut tries = 0;
            loop {
                let written = effects.get().and_then(|mut conn| {
                    if ctx.id % 2 == 1 {
                        return insert(&mut conn).map(|()| true);
                    }
                    // The effect commits only with the completion: a claim lost meanwhile
                    // (it lapsed on a busy machine and the job was rescued) rolls it back.
                    tenure::transaction(&mut conn, |conn| {
                        insert(conn)?;
                        let outcome = jobs::complete(conn, &[ctx.claim()])?;
                        if outcome != [jobs::Outcome::Done] {
                            return Err(diesel::result::Error::RollbackTransaction.into());
                        }
                        Ok(true)
                    })
                });
                match written {
                    Ok(_) => return Ok(()),
                    Err(e) if e.is_retryable() && tries < 100 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(JobError::retry(format!("effect: {e}"))),
                }
            }
        })
        .start()
        .expect("start the worker");
    report("started");
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let _ = worker.report();
    }
}

/// A worker process of the queue-wide limit scenario: 4 threads on queue "capped"; each run
/// writes its interval (database time: started when the handler begins, ended before it
/// returns, so inside the job's running state) and takes 20-40 ms. Exits when the queue has
/// nothing left.
fn capped_worker(url: &str) {
    let pool = Pool::options().max_size(8).open(url).expect("pool");
    let intervals = pool.clone();
    let worker = Worker::builder(pool.clone())
        .queue("capped")
        .threads(4)
        .claim_ttl(Duration::from_secs(60))
        .poll_interval(Duration::from_millis(20))
        .raw_handler("work", move |ctx: &JobContext, _: &[u8]| {
            let backend = intervals.backend();
            let mut conn = intervals.get()?;
            let started = now_text(&mut conn, backend)?;
            std::thread::sleep(Duration::from_millis(20 + (ctx.id as u64 * 7919) % 21));
            let ended = now_text(&mut conn, backend)?;
            diesel::sql_query(sql(
                backend,
                "INSERT INTO fault_intervals (job_id, started, ended) VALUES (?, ?, ?)",
            ))
            .bind::<BigInt, _>(ctx.id)
            .bind::<Text, _>(started)
            .bind::<Text, _>(ended)
            .execute(&mut *conn)?;
            Ok(())
        })
        .start()
        .expect("start the worker");
    report("started");
    let mut conn = pool.get().expect("conn");
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let left = jobs::stats(&mut conn).expect("stats");
        let busy = left
            .queues
            .iter()
            .filter(|q| q.queue == "capped")
            .any(|q| q.waiting > 0 || q.running > 0);
        if !busy {
            break;
        }
    }
    worker.shutdown(Duration::from_secs(10));
    report("done");
}

/// `?` placeholders as the backend wants them (`$1, $2, ...` on PostgreSQL).
pub fn sql(backend: tenure::Backend, template: &str) -> String {
    if backend != tenure::Backend::Postgres {
        return template.to_string();
    }
    let mut out = String::new();
    let mut n = 0;
    for ch in template.chars() {
        if ch == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(ch);
        }
    }
    out
}

/// The database's now as sortable text (microseconds; milliseconds on SQLite).
pub fn now_text(conn: &mut tenure::AnyConnection, backend: tenure::Backend) -> QueryResult<String> {
    #[derive(QueryableByName)]
    struct Now {
        #[diesel(sql_type = Text)]
        now: String,
    }
    let expr = match backend {
        tenure::Backend::Postgres => {
            "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')"
        }
        tenure::Backend::Mysql => "DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:%s.%f')",
        _ => "strftime('%Y-%m-%d %H:%M:%f','now')",
    };
    Ok(diesel::sql_query(format!("SELECT {expr} AS now"))
        .get_result::<Now>(conn)?
        .now)
}

/// The paused-holder scenario's holder: takes the lease through a guard, then every 50 ms
/// writes a row under it (verify inside the transaction) and reports what happened.
fn holder(url: &str) {
    let pool = Pool::options().max_size(4).open(url).expect("pool");
    let guard = LeaseGuard::take(
        pool.get().expect("conn"),
        "paused",
        Duration::from_millis(1000),
        "holder",
        Wait::up_to(Duration::from_secs(5)),
    )
    .expect("take")
    .expect("the lease was free");
    report(format!("held {}", guard.fence()));
    let mut conn = pool.get().expect("conn");
    let backend = pool.backend();
    let mut was_held = true;
    for _ in 0..400 {
        std::thread::sleep(Duration::from_millis(50));
        let wrote = tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            diesel::sql_query(sql(backend, "INSERT INTO fault_writes (fence) VALUES (?)"))
                .bind::<BigInt, _>(guard.fence())
                .execute(&mut **conn)
                .map_err(tenure::Error::from)
        });
        match wrote {
            Ok(_) => report("wrote"),
            Err(e) if e.is_lease_lost() => report("refused"),
            Err(e) => report(format!("error {e}")),
        }
        if was_held && !guard.is_held() {
            was_held = false;
            report("lost");
        }
    }
}

/// One process of the mutual-exclusion scenario: `iterations` times, take the lease (with
/// a wait), read the counter, sleep, write it plus one and record the holding interval by the
/// database's clock, all in one transaction that verifies the lease; then release.
fn counter(url: &str, iterations: usize) {
    let pool = Pool::options().max_size(4).open(url).expect("pool");
    let backend = pool.backend();
    let mut conn = pool.get().expect("conn");
    let mut done = 0;
    while done < iterations {
        let Some(guard) = LeaseGuard::take(
            pool.get().expect("conn"),
            "counter",
            Duration::from_secs(5),
            "counter",
            Wait::up_to(Duration::from_secs(30)).poll_interval(Duration::from_millis(5)),
        )
        .expect("take") else {
            continue;
        };
        let result = tenure::transaction(&mut conn, |conn| {
            guard.lease().verify(conn)?;
            let c: &mut tenure::AnyConnection = conn;
            #[derive(QueryableByName)]
            struct Value {
                #[diesel(sql_type = BigInt)]
                value: i64,
            }
            let value = diesel::sql_query("SELECT value FROM fault_counter")
                .get_result::<Value>(c)?
                .value;
            let started = now_text(c, backend)?;
            std::thread::sleep(Duration::from_millis(3));
            diesel::sql_query(sql(backend, "UPDATE fault_counter SET value = ?"))
                .bind::<BigInt, _>(value + 1)
                .execute(c)?;
            let ended = now_text(c, backend)?;
            diesel::sql_query(sql(
                backend,
                "INSERT INTO fault_intervals (fence, started, ended) VALUES (?, ?, ?)",
            ))
            .bind::<BigInt, _>(guard.fence())
            .bind::<Text, _>(started)
            .bind::<Text, _>(ended)
            .execute(c)
            .map_err(tenure::Error::from)
        });
        result.expect("a write under the held lease");
        guard.release().expect("release");
        done += 1;
    }
    report("done");
}

/// One process of the SQLite contention scenario: enqueue, claim and complete `operations`
/// jobs, one call at a time; any error is reported.
/// The session of the processes sharing one SQLite file: a busy timeout of 30 s, past what a
/// loaded machine makes a writer of another process wait.
pub fn shared_file_session() -> tenure::SessionSetup {
    tenure::SessionSetup::default().busy_timeout(Duration::from_secs(30))
}

fn sqlite_load(url: &str, operations: usize) {
    let pool = Pool::options()
        .max_size(2)
        .session(shared_file_session())
        .open(url)
        .expect("pool");
    let mut conn = pool.get().expect("conn");
    let mut errors = 0;
    for i in 0..operations {
        let step = jobs::enqueue(&mut conn, &jobs::NewJob::new("load", "k", vec![i as u8]))
            .and_then(|_| jobs::claim(&mut conn, "load", 1, Duration::from_secs(60)))
            .and_then(|claimed| {
                let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
                if claims.is_empty() {
                    Ok(vec![])
                } else {
                    jobs::complete(&mut conn, &claims)
                }
            });
        if let Err(e) = step {
            errors += 1;
            report(format!("error {e}"));
        }
    }
    report(format!("done {errors}"));
}

/// Opens a write transaction on the SQLite file, reports, and sleeps in it (the test stops
/// or kills this process there).
fn sqlite_stuck_writer(url: &str) {
    let pool = Pool::options().max_size(1).open(url).expect("pool");
    let mut conn = pool.get().expect("conn");
    let _ = tenure::transaction(&mut conn, |conn| {
        jobs::enqueue(conn, &jobs::NewJob::new("stuck", "k", vec![]))?;
        report("in-transaction");
        std::thread::sleep(Duration::from_secs(60));
        Ok::<(), tenure::Error>(())
    });
}

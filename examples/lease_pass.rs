//! A periodic pass that must run one at a time, guarded by a lease, shared by several threads
//! and two processes; one holder is killed mid-pass and is taken over after its ttl.
//!
//! ```text
//! cargo run --example lease_pass                      # embedded SQLite file
//! cargo run --example lease_pass --all-features -- postgres://root@127.0.0.1/test
//! ```
//!
//! Every pass records its fence and its interval (database clock) in its own transaction,
//! after checking the lease is still held (`Lease::verify`): a holder that lost its lease
//! cannot record anything. At the end the example checks that no two intervals overlap.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::lease::{self, Wait};
use tenure::{Error, LeaseGuard, Pool, TenureConnection};

const LEASE: &str = "example-periodic-pass";
const TTL: Duration = Duration::from_secs(1);
const RUN_FOR: Duration = Duration::from_secs(4);

type BoxError = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let result = match args.get(1).map(String::as_str) {
        Some("--victim") => victim(&args[2]),
        Some("--worker") => worker_process(&args[2]),
        _ => {
            let url = args
                .get(1)
                .cloned()
                .unwrap_or_else(|| "tenure-example.db".to_string());
            coordinator(&url)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn open(url: &str) -> Result<Pool, Error> {
    Pool::options().max_size(8).open(url)
}

/// Creates the example's table (the lease table comes with tenure's migrations).
fn prepare(pool: &Pool) -> Result<(), Error> {
    let mut conn = pool.get()?;
    tenure::run_migrations(&mut conn)?;
    diesel::sql_query("DROP TABLE IF EXISTS example_passes").execute(&mut conn)?;
    diesel::sql_query(
        "CREATE TABLE example_passes (fence BIGINT PRIMARY KEY, holder TEXT NOT NULL, \
         started TEXT NOT NULL, ended TEXT NOT NULL)",
    )
    .execute(&mut conn)?;
    // A holder left over from an earlier run of this example.
    lease::force_release(&mut conn, LEASE)?;
    Ok(())
}

/// One pass: hold the lease, work a little while checking it is still held, then record the
/// pass in a transaction that verifies the lease first.
fn one_pass(pool: &Pool, who: &str) -> Result<bool, Error> {
    let wait = Wait::up_to(Duration::from_millis(500)).poll_interval(Duration::from_millis(50));
    let Some(guard) = LeaseGuard::take(pool.get()?, LEASE, TTL, who, wait)? else {
        return Ok(false);
    };
    // The moment the take won the row (database clock), so after the previous holder's
    // release or expiry even when the take waited for that holder's row lock.
    let started = guard.lease().acquired_at();
    for _ in 0..5 {
        if !guard.is_held() {
            println!("  {who}: lost the lease mid-pass, stopping");
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    let mut conn = pool.get()?;
    let recorded = tenure::transaction(&mut conn, |c| {
        guard.lease().verify(c)?;
        let ended = tenure::database_now(c)?;
        record(c, guard.fence(), who, started, ended)
    });
    match recorded {
        Ok(()) => Ok(true),
        Err(e) if e.is_lease_lost() => Ok(false),
        Err(e) => Err(e),
    }
}

fn record(
    conn: &mut tenure::PooledConnection,
    fence: i64,
    who: &str,
    started: DateTime<Utc>,
    ended: DateTime<Utc>,
) -> Result<(), Error> {
    let sql = match conn.backend() {
        tenure::Backend::Postgres => "INSERT INTO example_passes VALUES ($1, $2, $3, $4)",
        _ => "INSERT INTO example_passes VALUES (?, ?, ?, ?)",
    };
    diesel::sql_query(sql)
        .bind::<BigInt, _>(fence)
        .bind::<Text, _>(who)
        .bind::<Text, _>(started.format("%Y-%m-%d %H:%M:%S%.6f").to_string())
        .bind::<Text, _>(ended.format("%Y-%m-%d %H:%M:%S%.6f").to_string())
        .execute(&mut **conn)?;
    Ok(())
}

/// Passes in a loop until the time is up.
fn work_until(pool: &Pool, who: &str, until: Instant) -> Result<usize, Error> {
    let mut passes = 0;
    while Instant::now() < until {
        if one_pass(pool, who)? {
            passes += 1;
            // The pass is done for now: give the others a turn before the next one.
            std::thread::sleep(Duration::from_millis(150));
        }
    }
    Ok(passes)
}

/// A second process that takes part in the passes.
fn worker_process(url: &str) -> Result<(), BoxError> {
    let pool = open(url)?;
    let who = format!("process {}", std::process::id());
    work_until(&pool, &who, Instant::now() + RUN_FOR)?;
    Ok(())
}

/// A process that takes the lease, says so, and hangs until it is killed.
fn victim(url: &str) -> Result<(), BoxError> {
    let pool = open(url)?;
    let mut conn = pool.get()?;
    let wait = Wait::up_to(Duration::from_secs(10));
    let who = format!("victim {}", std::process::id());
    let held = lease::take(&mut conn, LEASE, TTL, &who, wait)?.ok_or("the lease stayed busy")?;
    println!("holding fence {}", held.fence());
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

fn coordinator(url: &str) -> Result<(), BoxError> {
    let pool = open(url)?;
    prepare(&pool)?;
    let exe = std::env::current_exe()?;
    println!(
        "tenure lease example on {} (lease ttl {TTL:?})",
        pool.backend()
    );

    // 1. A process takes the lease and is killed while holding it.
    let mut victim = Command::new(&exe)
        .args(["--victim", url])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    if let Some(out) = victim.stdout.take() {
        BufReader::new(out).read_line(&mut line).ok();
    }
    let killed_at = Instant::now();
    victim.kill().ok();
    victim.wait().ok();
    println!(
        "killed the victim (pid {}) while it was {}",
        victim.id(),
        line.trim()
    );
    let mut conn = pool.get()?;
    let wait = Wait::up_to(TTL * 5).poll_interval(Duration::from_millis(50));
    let mut successor = lease::take(&mut conn, LEASE, TTL, "coordinator", wait)?
        .ok_or("the killed holder's lease was not taken over")?;
    println!(
        "taken over with fence {} after {:?} (the ttl is {TTL:?})",
        successor.fence(),
        killed_at.elapsed()
    );
    successor.release(&mut conn)?;

    // 2. Three threads here and one other process share the pass for a few seconds.
    println!("three threads and another process take turns for {RUN_FOR:?}...");
    let other = Command::new(&exe).args(["--worker", url]).spawn()?;
    let until = Instant::now() + RUN_FOR;
    let failed = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (1..=3)
        .map(|n| {
            let (pool, failed) = (pool.clone(), failed.clone());
            std::thread::spawn(move || {
                if let Err(e) = work_until(&pool, &format!("thread {n}"), until) {
                    eprintln!("thread {n}: {e}");
                    failed.store(true, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().ok();
    }
    let mut other = other;
    other.wait().ok();

    // 3. The record: fences increase, intervals never overlap.
    #[derive(QueryableByName)]
    struct Pass {
        #[diesel(sql_type = BigInt)]
        fence: i64,
        #[diesel(sql_type = Text)]
        holder: String,
        #[diesel(sql_type = Text)]
        started: String,
        #[diesel(sql_type = Text)]
        ended: String,
    }
    let passes: Vec<Pass> = diesel::sql_query(
        "SELECT fence, holder, started, ended FROM example_passes ORDER BY fence",
    )
    .load(&mut *conn)?;
    let mut overlaps = 0;
    for (i, pass) in passes.iter().enumerate() {
        let overlap = i > 0 && pass.started < passes[i - 1].ended;
        overlaps += usize::from(overlap);
        println!(
            "  fence {:>4}  {:<16} {} .. {}{}",
            pass.fence,
            pass.holder,
            &pass.started[11..],
            &pass.ended[11..],
            if overlap { "  OVERLAP" } else { "" }
        );
    }
    println!("{} passes, {overlaps} overlaps", passes.len());
    if overlaps > 0 || failed.load(Ordering::Relaxed) {
        return Err("passes overlapped or a worker failed".into());
    }
    Ok(())
}

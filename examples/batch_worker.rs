//! A thread-pool batch worker: checksums every file of a directory with N threads, and
//! picks up where it left off after a kill.
//!
//! ```text
//! cargo run --example batch_worker                          # this crate's src/, SQLite file
//! cargo run --example batch_worker -- DIR [URL] [--threads N]
//! ```
//!
//! Each file is one job (its path is the job's dedup key, so a rerun never enqueues a file
//! twice while its job is live). The handler writes the file's checksum and completes its
//! job in one transaction: exactly once, even across kills. A rerun enqueues only files
//! without a checksum yet, and finishes the jobs a killed run left (their claims lapse and
//! are rescued).
//!
//! Run without a directory, it proves that: it starts a copy of itself that dies abruptly
//! (like `kill -9`) after a few files, then resumes here and checks every file has exactly
//! one checksum.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use tenure::jobs::{self, NewJob};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{Error, Pool, TenureConnection};

type BoxError = Box<dyn std::error::Error>;

const QUEUE: &str = "checksums";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(4);
    let crash_after = args
        .iter()
        .position(|a| a == "--crash-after")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok());
    let positional: Vec<&String> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| !a.starts_with("--") && (*i == 0 || !args[i - 1].starts_with("--")))
        .map(|(_, a)| a)
        .collect();
    let result = match positional.first() {
        // `batch_worker URL`: the directory comes first.
        Some(first) if first.contains("://") || first.ends_with(".db") => {
            eprintln!(
                "error: {first:?} looks like a database URL, and the first argument is the directory to checksum\n\
                 usage: batch_worker [DIR [URL]] [--threads N]   (no DIR: the self-check on this crate's src/)"
            );
            return ExitCode::from(2);
        }
        Some(dir) if !Path::new(dir.as_str()).is_dir() => {
            eprintln!(
                "error: {dir:?} is not a directory\n\
                 usage: batch_worker [DIR [URL]] [--threads N]   (no DIR: the self-check on this crate's src/)"
            );
            return ExitCode::from(2);
        }
        Some(dir) => {
            let url = positional.get(1).map_or("tenure-batch.db", |u| u.as_str());
            run(Path::new(dir.as_str()), url, threads, crash_after).map(|_| ())
        }
        None => self_check(threads),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Kills a first run part-way, resumes, and checks every file got exactly one checksum.
fn self_check(threads: usize) -> Result<(), BoxError> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let url = "tenure-batch.db";
    for file in [url, "tenure-batch.db-wal", "tenure-batch.db-shm"] {
        let _ = std::fs::remove_file(file);
    }
    println!("first run: a copy of this program that dies abruptly after 10 files");
    let status = Command::new(std::env::current_exe()?)
        .arg(&dir)
        .arg(url)
        .args(["--threads", &threads.to_string(), "--crash-after", "10"])
        .status()?;
    println!("  it died ({status})");
    println!("second run: resume");
    let files = run(&dir, url, threads, None)?;
    let pool = Pool::open(url)?;
    let mut conn = pool.get()?;
    let rows = count(&mut conn, "SELECT COUNT(*) AS n FROM example_checksums")?;
    let distinct = count(
        &mut conn,
        "SELECT COUNT(DISTINCT path) AS n FROM example_checksums",
    )?;
    if rows != files as i64 || distinct != rows {
        return Err(format!("{files} files, {rows} checksums ({distinct} distinct)").into());
    }
    println!("every one of {files} files has exactly one checksum");
    Ok(())
}

/// Enqueues the files of `dir` that have no checksum yet, then works until none is left.
/// Returns how many files there are.
fn run(
    dir: &Path,
    url: &str,
    threads: usize,
    crash_after: Option<usize>,
) -> Result<usize, BoxError> {
    let pool = Pool::options().max_size(threads as u32 + 4).open(url)?;
    let mut conn = pool.get()?;
    tenure::run_migrations(&mut conn)?;
    diesel::sql_query(
        "CREATE TABLE IF NOT EXISTS example_checksums (path VARCHAR(255) PRIMARY KEY, \
         bytes BIGINT NOT NULL, checksum BIGINT NOT NULL)",
    )
    .execute(&mut *conn)?;
    let files = files_of(dir)?;
    let mut fresh = Vec::new();
    for file in &files {
        let path = file.display().to_string();
        let done = diesel::sql_query(sql(
            &pool,
            "SELECT COUNT(*) AS n FROM example_checksums WHERE path = ?",
        ))
        .bind::<Text, _>(&path)
        .get_result::<N>(&mut *conn)?
        .n;
        if done == 0 {
            fresh.push(NewJob::new(QUEUE, "checksum", path.clone().into_bytes()).dedup_key(path));
        }
    }
    if !fresh.is_empty() {
        let enqueued = jobs::enqueue_many(&mut conn, &fresh)?;
        let existing = enqueued.iter().filter(|e| e.existing).count();
        println!(
            "  {} files to do ({} already queued by an earlier run)",
            fresh.len(),
            existing
        );
    }
    drop(conn);

    let ran = Arc::new(AtomicUsize::new(0));
    let counter = ran.clone();
    let results = pool.clone();
    let worker = Worker::builder(pool.clone())
        .queue(QUEUE)
        .threads(threads)
        // Short claims, so the jobs a killed run held come back soon.
        .claim_ttl(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(200))
        .raw_handler("checksum", move |ctx: &JobContext, payload: &[u8]| {
            let path = String::from_utf8_lossy(payload).into_owned();
            let bytes = std::fs::read(&path)?;
            let sum = fnv1a(&bytes);
            let mut conn = results.get()?;
            let backend = results.backend();
            // The checksum and the completion commit together, or neither does.
            tenure::transaction(&mut conn, |conn| {
                diesel::sql_query(sql_for(
                    backend,
                    "INSERT INTO example_checksums (path, bytes, checksum) VALUES (?, ?, ?)",
                ))
                .bind::<Text, _>(&path)
                .bind::<BigInt, _>(bytes.len() as i64)
                .bind::<BigInt, _>(sum as i64)
                .execute(&mut **conn)?;
                jobs::complete(conn, &[ctx.claim()])
            })?;
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            if crash_after == Some(n) {
                // Like kill -9: no shutdown, no give-back; other threads' claims are left.
                std::process::exit(137);
            }
            Ok::<(), JobError>(())
        })
        .start()?;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let stats = jobs::stats(&mut pool.get()?)?;
        let left = stats
            .queues
            .iter()
            .find(|q| q.queue == QUEUE)
            .map_or(0, |q| q.waiting + q.running);
        if left == 0 {
            break;
        }
    }
    let report = worker.shutdown(Duration::from_secs(5));
    println!(
        "  checksummed {} files on {threads} threads ({} runs found their job already done)",
        ran.load(Ordering::SeqCst),
        report.lost
    );
    Ok(files.len())
}

/// The files of `dir` and of its subdirectories.
fn files_of(dir: &Path) -> Result<Vec<PathBuf>, BoxError> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |hash, b| {
        (hash ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}

#[derive(QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn count<C: TenureConnection + diesel::Connection>(conn: &mut C, query: &str) -> Result<i64, Error>
where
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, C, N>,
{
    Ok(diesel::sql_query(query).get_result::<N>(conn)?.n)
}

fn sql(pool: &Pool, template: &str) -> String {
    sql_for(pool.backend(), template)
}

/// `?` placeholders as the backend wants them.
fn sql_for(backend: tenure::Backend, template: &str) -> String {
    if backend != tenure::Backend::Postgres {
        return template.to_string();
    }
    let mut n = 0;
    template
        .chars()
        .map(|c| {
            if c == '?' {
                n += 1;
                format!("${n}")
            } else {
                c.to_string()
            }
        })
        .collect()
}

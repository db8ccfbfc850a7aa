//! `tenure demo`: a realistic batch, a worker pool, a live progress bar, and a summary.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tenure::jobs::{self, Backoff, Finished, NewJob, Retention};
use tenure::lease::Wait;
use tenure::schedules::{self, Schedule};
use tenure::worker::{JobContext, JobError, Worker};
use tenure::{LeaseGuard, Pool};

use crate::output::line;
use crate::{Failure, Outcome, database};

#[derive(Args)]
pub struct DemoArgs {
    /// How many jobs to enqueue.
    #[arg(long, default_value_t = 5000)]
    jobs: usize,
    /// Worker threads.
    #[arg(long, default_value_t = 8)]
    threads: usize,
}

const QUEUE: &str = "demo";
const DEMO_FILE: &str = "tenure-demo.db";
const SYNC_LEASE: &str = "demo-sync-account-42";

pub fn run(args: DemoArgs, flag_url: Option<String>) -> Outcome {
    if args.jobs < 100 {
        return Err(Failure::new(2, "the demo needs at least 100 jobs"));
    }
    // Only --database-url: a TENURE_DATABASE_URL or DATABASE_URL set for other programs must
    // not receive the demo's batch (or lose its `demo` queue's jobs).
    let url = match flag_url {
        Some(url) => url,
        None => {
            // The demo's own file, fresh each time.
            for file in [DEMO_FILE, "tenure-demo.db-wal", "tenure-demo.db-shm"] {
                let _ = std::fs::remove_file(file);
            }
            DEMO_FILE.to_string()
        }
    };
    let pool = database::pool(&url, args.threads as u32 + 6)?;
    let mut conn = pool.get()?;
    tenure::run_migrations(&mut conn)?;
    // Leftovers of an earlier demo on this database.
    for finished in [Finished::Completed, Finished::Dead, Finished::Cancelled] {
        while jobs::prune(
            &mut conn,
            QUEUE,
            finished,
            Retention::DeleteAll,
            jobs::MAX_BATCH,
        )? == jobs::MAX_BATCH
        {}
    }
    let leftovers = jobs::list(
        &mut conn,
        &jobs::JobFilter {
            queue: Some(QUEUE.into()),
            limit: jobs::MAX_BATCH,
            ..Default::default()
        },
    )?;
    for job in leftovers {
        jobs::cancel(&mut conn, job.id)?;
    }
    while jobs::prune(
        &mut conn,
        QUEUE,
        Finished::Cancelled,
        Retention::DeleteAll,
        jobs::MAX_BATCH,
    )? == jobs::MAX_BATCH
    {}
    schedules::remove(&mut conn, "demo-heartbeat")?;

    // The batch: thumbnails (quick), emails (a tenth fail once and retry; a few never
    // succeed and end dead), reports (delayed 1-3 s), and account syncs that must run one at
    // a time (a lease).
    let n = args.jobs;
    let (emails, reports, syncs) = (n / 5, n / 20, 40.min(n / 10));
    let thumbnails = n - emails - reports - syncs;
    let mut batch = Vec::with_capacity(n);
    batch.extend(
        (0..thumbnails).map(|i| NewJob::new(QUEUE, "thumbnail", i.to_string().into_bytes())),
    );
    batch.extend(
        (0..emails)
            .map(|i| NewJob::new(QUEUE, "email", i.to_string().into_bytes()).max_attempts(3)),
    );
    batch.extend((0..reports).map(|i| {
        NewJob::new(QUEUE, "report", i.to_string().into_bytes())
            .delay(Duration::from_millis(1000 + (i as u64 * 37) % 2000))
    }));
    batch.extend((0..syncs).map(|i| NewJob::new(QUEUE, "sync", i.to_string().into_bytes())));
    let enqueue_started = Instant::now();
    jobs::enqueue_many(&mut conn, &batch)?;
    let enqueue_took = enqueue_started.elapsed();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "demo-heartbeat",
            Duration::from_secs(1),
            NewJob::new(QUEUE, "tick", vec![]),
        ),
    )?;
    drop(conn);
    line(&format!(
        "tenure demo on {}: enqueued {n} jobs in {:.0} ms ({thumbnails} thumbnails, {emails} \
         emails, {reports} delayed reports, {syncs} account syncs) and a schedule ticking \
         every second.\nThe last jobs wait for their retries (a backoff of 0.2 to 2 s; a \
         few emails fail for good after 3 attempts) and for the delayed reports (due 1 to 3 s \
         after enqueueing), so the count slows near its end.",
        pool.backend(),
        enqueue_took.as_secs_f64() * 1000.0
    ))?;

    let syncing = Arc::new(AtomicUsize::new(0));
    let most_syncing = Arc::new(AtomicUsize::new(0));
    let fences = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sync_pool = pool.clone();
    let ticks = Arc::new(AtomicUsize::new(0));
    let tick_count = ticks.clone();
    let (now, most, fence_log) = (syncing.clone(), most_syncing.clone(), fences.clone());
    let worker = Worker::builder(pool.clone())
        .queue(QUEUE)
        .threads(args.threads)
        .run_schedules()
        .poll_interval(Duration::from_millis(100))
        .raw_handler("thumbnail", |_: &JobContext, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(1));
            Ok(())
        })
        .raw_handler("email", |ctx: &JobContext, payload: &[u8]| {
            let i: usize = std::str::from_utf8(payload)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis(2));
            if i % 97 == 0 {
                return Err(JobError::retry("mailbox does not exist"));
            }
            if i % 10 == 0 && ctx.attempt == 1 {
                return Err(JobError::retry("SMTP server busy, try later"));
            }
            Ok(())
        })
        .kind_backoff(
            "email",
            Backoff {
                base: Duration::from_millis(200),
                max: Duration::from_secs(2),
            },
        )
        .raw_handler("report", |_: &JobContext, _: &[u8]| {
            std::thread::sleep(Duration::from_millis(5));
            Ok(())
        })
        .raw_handler("sync", move |_: &JobContext, _: &[u8]| {
            // One account, one sync at a time, across threads, processes and hosts.
            let guard = LeaseGuard::take_pooled(
                &sync_pool,
                SYNC_LEASE,
                Duration::from_secs(10),
                "demo",
                Wait::up_to(Duration::from_secs(60)).poll_interval(Duration::from_millis(5)),
            )?
            .ok_or_else(|| JobError::retry("the account is busy"))?;
            let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(at_once, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(10));
            now.fetch_sub(1, Ordering::SeqCst);
            fence_log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(guard.fence());
            guard.release()?;
            Ok(())
        })
        .raw_handler("tick", move |_: &JobContext, _: &[u8]| {
            tick_count.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .start()?;

    let started = Instant::now();
    let expected_dead = (0..emails).filter(|i| i % 97 == 0).count();
    let progress = Progress::new(n)?;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let report = worker.report();
        let finished =
            (report.completed + report.dead).saturating_sub(ticks.load(Ordering::SeqCst));
        let queue = jobs::stats(&mut pool.get()?)?
            .queues
            .into_iter()
            .find(|q| q.queue == QUEUE);
        let waiting = queue.as_ref().map_or(0, |q| q.waiting + q.running);
        // Nothing due and nothing running: what is left waits for its time.
        let idle = queue
            .as_ref()
            .is_some_and(|q| q.running == 0 && q.waiting > 0 && q.oldest_waiting.is_zero());
        let note = if idle && finished < n {
            not_due(&pool)?
        } else {
            String::new()
        };
        progress.update(finished.min(n), report.retried, report.dead, &note)?;
        if finished >= n && waiting == 0 && report.dead >= expected_dead {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(Failure::new(1, "the demo did not finish within 10 minutes"));
        }
    }
    let took = started.elapsed();
    let report = worker.shutdown(Duration::from_secs(5));
    progress.finish(report.retried, report.dead)?;
    let fences = fences.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let ticks = ticks.load(Ordering::SeqCst);
    let completed = report.completed - ticks;
    let summary = [
        (
            "processed",
            format!(
                "{} runs of {n} jobs: {completed} completed, {} dead",
                completed + report.dead + report.retried,
                report.dead
            ),
        ),
        (
            "retried",
            format!("{} runs failed and were retried", report.retried),
        ),
        (
            "dead",
            format!("{} job(s) failed for good after 3 attempts", report.dead),
        ),
        (
            "throughput",
            format!(
                "{:.0} jobs/s over {:.1} s with {} threads",
                (completed + report.dead) as f64 / took.as_secs_f64(),
                took.as_secs_f64(),
                args.threads
            ),
        ),
        (
            "schedule",
            format!("{ticks} heartbeat ticks fired, each once"),
        ),
        (
            "lease",
            format!(
                "{SYNC_LEASE}: {} syncs, at most {} at a time, fences {}..{}",
                fences.len(),
                most_syncing.load(Ordering::SeqCst),
                fences.iter().min().copied().unwrap_or(0),
                fences.iter().max().copied().unwrap_or(0)
            ),
        ),
    ];
    line("")?;
    for (name, text) in summary {
        line(&format!("{name:>10}  {text}"))?;
    }
    // A real job to show: the first dead one, else any of the demo's.
    let dead_first = [Some(jobs::JobState::Dead), None]
        .into_iter()
        .find_map(|state| {
            let filter = jobs::JobFilter {
                queue: Some(QUEUE.into()),
                state,
                limit: 1,
                ..Default::default()
            };
            jobs::list(&mut pool.get().ok()?, &filter)
                .ok()?
                .first()
                .map(|job| job.id)
        });
    line(&next_steps(&url, &program(), dead_first.unwrap_or(1)))?;
    if most_syncing.load(Ordering::SeqCst) > 1 {
        return Err(Failure::new(1, "two syncs ran at once: the lease failed"));
    }
    Ok(())
}

/// The live count: an indicatif bar on a terminal; on a file or a pipe, a plain line every
/// two seconds and one whenever the note changes (no carriage returns, no escapes).
struct Progress {
    bar: ProgressBar,
    plain: bool,
    total: usize,
    started: Instant,
    last_line: std::cell::Cell<Option<Instant>>,
    last_note: std::cell::RefCell<String>,
}

impl Progress {
    fn new(total: usize) -> Result<Progress, Failure> {
        let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stdout());
        let style = ProgressStyle::with_template("[{bar:30}] {pos:>6}/{len} jobs  {msg}")
            .map_err(|e| Failure::new(1, format!("the progress bar's template: {e}")))?
            .progress_chars("#>.");
        bar.set_style(style);
        Ok(Progress {
            plain: bar.is_hidden(),
            bar,
            total,
            started: Instant::now(),
            last_line: std::cell::Cell::new(None),
            last_note: std::cell::RefCell::new(String::new()),
        })
    }

    fn update(&self, finished: usize, retried: usize, dead: usize, note: &str) -> Outcome {
        let rate = finished as f64 / self.started.elapsed().as_secs_f64().max(0.001);
        let counts = format!("{rate:.0} jobs/s, retried {retried}, dead {dead}");
        let message = if note.is_empty() {
            counts.clone()
        } else {
            format!("{counts}; {note}")
        };
        if !self.plain {
            self.bar.set_position(finished as u64);
            self.bar.set_message(message);
            return Ok(());
        }
        let now = Instant::now();
        let due = self
            .last_line
            .get()
            .is_none_or(|at| now - at >= Duration::from_secs(2));
        let new_note = !note.is_empty() && *self.last_note.borrow() != note;
        if due || new_note {
            self.last_line.set(Some(now));
            *self.last_note.borrow_mut() = note.to_string();
            line(&format!(
                "{finished:>6}/{} jobs done, {message}",
                self.total
            ))?;
        }
        Ok(())
    }

    fn finish(&self, retried: usize, dead: usize) -> Outcome {
        if self.plain {
            // The count's last line, however recent the one before it.
            self.last_line.set(None);
            self.update(self.total, retried, dead, "")
        } else {
            self.bar.finish();
            Ok(())
        }
    }
}

/// What the jobs left are waiting for, when none is due: retries after their backoff, and
/// reports delayed on purpose.
fn not_due(pool: &Pool) -> Result<String, Failure> {
    let waiting = jobs::list(
        &mut pool.get()?,
        &jobs::JobFilter {
            queue: Some(QUEUE.into()),
            state: Some(jobs::JobState::Waiting),
            limit: jobs::MAX_BATCH,
            ..Default::default()
        },
    )?;
    let retries = waiting.iter().filter(|j| j.attempt > 0).count();
    let delayed = waiting
        .iter()
        .filter(|j| j.attempt == 0 && j.kind == "report")
        .count();
    Ok(match (retries, delayed) {
        (0, 0) => String::new(),
        (r, 0) => format!("waiting for {}", retries_text(r)),
        (0, d) => format!("waiting for {}", reports_text(d)),
        (r, d) => format!("waiting for {} and {}", retries_text(r), reports_text(d)),
    })
}

fn retries_text(n: usize) -> String {
    match n {
        1 => "1 retry after its backoff".into(),
        n => format!("{n} retries after their backoff"),
    }
}

fn reports_text(n: usize) -> String {
    match n {
        1 => "1 delayed report".into(),
        n => format!("{n} delayed reports"),
    }
}

/// Where the demo's jobs are, and the commands that look at them, runnable as printed:
/// `program` is how to call this command, `job` a real job's id.
fn next_steps(url: &str, program: &str, job: i64) -> String {
    let url = shell_quoted(&without_password(url));
    format!(
        "\nThe demo's jobs, schedule and lease are in {url}. Look at them with:\n  \
         {program} --database-url {url} stats\n  \
         {program} --database-url {url} jobs list --queue demo --state dead\n  \
         {program} --database-url {url} jobs show {job}\n  \
         {program} --database-url {url} schedules list"
    )
}

/// How to call this command: `tenure` when that is what the PATH finds, else this
/// executable's path (after `cargo run`, `target/debug/tenure` is on no PATH).
fn program() -> String {
    let Ok(this) = std::env::current_exe().and_then(std::fs::canonicalize) else {
        return "tenure".to_string();
    };
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("tenure"))
            .find(|candidate| candidate.is_file())
            .and_then(|found| std::fs::canonicalize(found).ok())
            .is_some_and(|found| found == this)
    });
    if on_path {
        "tenure".to_string()
    } else {
        shell_quoted(&this.display().to_string())
    }
}

/// A server URL with its password (in the authority, or a `password=` or `sslpassword=`
/// query parameter) replaced by PASSWORD, to print.
fn without_password(url: &str) -> String {
    let url = without_user_password(url);
    let Some((base, query)) = url.split_once('?') else {
        return url;
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            // libpq percent-decodes a parameter's name too (`pass%77ord=` is a password).
            Some((name, _))
                if ["password", "sslpassword"].iter().any(|secret| {
                    form_urlencoded::parse(name.as_bytes())
                        .any(|(decoded, _)| decoded.eq_ignore_ascii_case(secret))
                }) =>
            {
                format!("{name}=PASSWORD")
            }
            _ => pair.to_string(),
        })
        .collect();
    format!("{base}?{}", query.join("&"))
}

/// [`without_password`] for the password in the URL's authority (`USER:PASSWORD@`).
fn without_user_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    match rest[..at].split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:PASSWORD{}", &rest[at..]),
        None => url.to_string(),
    }
}

/// `text` as one shell word.
fn shell_quoted(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:@=".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_printed_in_the_next_steps() {
        for url in [
            "postgres://u:hunter2@h/db",
            "postgres://u@h/db?password=hunter2",
            "postgres://u@h/db?sslmode=disable&PASSWORD=hunter2",
            "postgres://u@h/db?pass%77ord=hunter2",
            "postgres://u@h/db?sslpassword=hunter2",
        ] {
            let text = next_steps(url, "tenure", 1);
            assert!(!text.contains("hunter2"), "{text}");
            assert!(text.contains("PASSWORD"), "{text}");
        }
    }
}

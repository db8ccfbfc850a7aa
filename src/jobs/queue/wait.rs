//! Waiting for a job to end ([`wait`], [`enqueue_and_wait`]): a blocking caller (a CLI, a
//! synchronous web handler) sleeps until the job is completed, dead or cancelled, or until its
//! timeout, holding no database connection while it sleeps.
//!
//! The waiters of one process on one database share their reads: one of them at a time reads
//! the states of every job any of them waits for, in one statement per [`MAX_BATCH`] jobs, at
//! most every [`POLL_INTERVAL`], and at once after a job ended in this process (a worker's
//! finish, a cancel: [`ended`]). So a hundred waiters cost the server what one does, and a job
//! finished in the waiter's own process is seen at once; one finished by another process
//! within a poll interval.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use diesel::RunQueryDsl;

use super::MAX_BATCH;
use super::model::{Job, JobState};
use super::new_job::NewJob;
use crate::backend::dispatch;
use crate::backend::statement::statement;
use crate::jobs::workflows::JobResult;
use crate::rows::IdStateRow;
use crate::{Error, Pool, Result};

/// How often the waiters of one process read their jobs' states while none of them ended in
/// this process: the longest a job finished by another process goes unseen.
pub const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// How a job ended, from [`wait`]: its row as it ended, and its result if it completed with
/// one.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    /// The job, in its final state ([`JobState::Completed`], [`JobState::Dead`] or
    /// [`JobState::Cancelled`]); for a dead job `last_error` says why.
    pub job: Job,
    /// Its result ([`crate::jobs::complete_with_result`]), if it completed with one.
    pub result: Option<JobResult>,
}

impl Ended {
    /// Whether the job completed.
    pub fn completed(&self) -> bool {
        self.job.state == JobState::Completed
    }
}

const STATES: &str = "SELECT id, state FROM tenure_jobs WHERE id IN {ids}";

/// What the waiters of one database share.
#[derive(Default)]
struct Board {
    /// Job id -> how many waiters wait for it.
    waited: HashMap<i64, usize>,
    /// The jobs a read found ended (or gone: `None`), until their waiters took them.
    read: HashMap<i64, Option<JobState>>,
    /// Whether a waiter is reading now.
    reading: bool,
    /// When the next read is due.
    next_read: Option<Instant>,
    /// [`Waits::ends`] when the last read began.
    ends_read: u64,
}

#[derive(Default)]
struct Waits {
    /// Per database (the pool's URL).
    boards: HashMap<Arc<str>, Board>,
    /// Jobs ended in this process, counted.
    ends: u64,
}

static WAITS: LazyLock<Mutex<Waits>> = LazyLock::new(Mutex::default);
static CHANGED: Condvar = Condvar::new();

fn waits() -> MutexGuard<'static, Waits> {
    WAITS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A job may have ended in this process (called after a finish or a cancel, committed or not:
/// a wake-up for a change not committed yet costs one read). Free when nobody waits.
pub(crate) fn ended() {
    let mut waits = waits();
    if waits.boards.is_empty() {
        return;
    }
    waits.ends += 1;
    CHANGED.notify_all();
}

/// Blocks until job `id` is completed, dead or cancelled, and returns how it ended; at most
/// `timeout`, after which it is [`Error::WaitTimedOut`] with the job's state then. The
/// first state it sees is final: a dead job revived later by
/// [`retry_dead`](crate::jobs::retry_dead) is returned dead. [`Error::NoSuchJob`] if there
/// is no such job (or retention deleted it while it waited). While it sleeps it holds no
/// connection of `pool`, and the waiters of one process on one database share one read
/// (see [`POLL_INTERVAL`]). A `timeout` too long to add to the clock is
/// [`Error::InvalidInput`].
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("app.db").display().to_string();
/// use std::time::Duration;
/// use tenure::jobs::{self, JobResult, JobState, NewJob};
/// let pool = tenure::Pool::open(&url)?;
/// tenure::run_migrations(&mut pool.get()?)?;
/// let id = jobs::enqueue(&mut pool.get()?, &NewJob::new("shots", "render", vec![]))?.id;
/// let worker = {
///     let pool = pool.clone();
///     std::thread::spawn(move || -> Result<(), tenure::Error> {
///         let mut conn = pool.get()?;
///         let job = jobs::claim(&mut conn, "shots", 1, Duration::from_secs(60))?.remove(0);
///         jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json("shot.png")?)?;
///         Ok(())
///     })
/// };
/// let ended = jobs::wait(&pool, id, Duration::from_secs(30))?;
/// assert_eq!(ended.job.state, JobState::Completed);
/// assert_eq!(ended.result.unwrap().decode::<String>()?, "shot.png");
/// # worker.join().unwrap()?;
/// # Ok(()) }
/// ```
pub fn wait(pool: &Pool, id: i64, timeout: Duration) -> Result<Ended> {
    let deadline = deadline_after(timeout)?;
    // The job as it is now: ended already, or no such job, without waiting.
    let job = get(pool, id)?;
    if is_final(job.state) {
        return ended_job(pool, job);
    }
    match await_ended(pool, &[id], deadline)? {
        Some(seen) if seen.get(&id).copied().flatten().is_some() => ended_job(pool, get(pool, id)?),
        Some(_) => Err(Error::NoSuchJob { id }),
        // Timed out: the state now (it may have just ended).
        None => {
            let job = get(pool, id)?;
            if is_final(job.state) {
                return ended_job(pool, job);
            }
            Err(Error::WaitTimedOut {
                id,
                state: job.state,
            })
        }
    }
}

/// The instant `timeout` from now, or [`Error::InvalidInput`] if that is past the clock's end.
pub(crate) fn deadline_after(timeout: Duration) -> Result<Instant> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| Error::invalid("timeout", "too long to wait for"))
}

/// Blocks until every job of `ids` has been read ended (`Some(state)`) or gone (`None`), and
/// returns what was read of each; `None` once `deadline` passes first. The waiting is the
/// process's shared board: one read per database for all its waiters, no connection held
/// while asleep.
pub(crate) fn await_ended(
    pool: &Pool,
    ids: &[i64],
    deadline: Instant,
) -> Result<Option<HashMap<i64, Option<JobState>>>> {
    let key = pool.url().clone();
    let mut waits = waits();
    for &id in ids {
        *board(&mut waits, &key).waited.entry(id).or_default() += 1;
    }
    let seen = loop {
        let ends = waits.ends;
        let board = board(&mut waits, &key);
        if ids.iter().all(|id| board.read.contains_key(id)) {
            break Ok(Some(ids.iter().map(|id| (*id, board.read[id])).collect()));
        }
        let now = Instant::now();
        if now >= deadline {
            break Ok(None);
        }
        let due = board.next_read.is_none_or(|at| at <= now) || board.ends_read < ends;
        if !board.reading && due {
            board.reading = true;
            board.ends_read = ends;
            let waited: Vec<i64> = board.waited.keys().copied().collect();
            drop(waits);
            let read = read_ended(pool, &waited);
            waits = self::waits();
            let board = self::board(&mut waits, &key);
            board.reading = false;
            board.next_read = Some(Instant::now() + POLL_INTERVAL);
            CHANGED.notify_all();
            match read {
                Ok(read) => {
                    for (job, state) in read {
                        if board.waited.contains_key(&job) {
                            board.read.insert(job, state);
                        }
                    }
                }
                Err(e) => break Err(e),
            }
            continue;
        }
        // Woken by a read, an end in this process, or the next read's time.
        let until = match board.next_read {
            Some(at) if !board.reading => at.min(deadline),
            _ => deadline,
        };
        let sleep = until
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        waits = CHANGED
            .wait_timeout(waits, sleep)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    };
    for &id in ids {
        leave(&mut waits, &key, id);
    }
    seen
}

/// Enqueues `job` (in a transaction of its own, committed before waiting) and [`wait`]s for
/// it: for a caller that needs the outcome before it answers. A job the enqueue merged into
/// an earlier one with the same dedup key waits for that one.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("app.db").display().to_string();
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let pool = tenure::Pool::open(&url)?;
/// tenure::run_migrations(&mut pool.get()?)?;
/// // No worker runs "thumbs" here: the wait ends at its timeout, the job still waiting.
/// let waited = jobs::enqueue_and_wait(&pool, &NewJob::new("thumbs", "make", vec![]), Duration::ZERO);
/// assert!(matches!(waited, Err(tenure::Error::WaitTimedOut { .. })));
/// # Ok(()) }
/// ```
pub fn enqueue_and_wait(pool: &Pool, job: &NewJob, timeout: Duration) -> Result<Ended> {
    // The deadline is checked first, so that a bad timeout enqueues nothing.
    deadline_after(timeout)?;
    let id = super::enqueue(&mut pool.get()?, job)?.id;
    wait(pool, id, timeout)
}

fn board<'w>(waits: &'w mut Waits, key: &Arc<str>) -> &'w mut Board {
    waits.boards.entry(key.clone()).or_default()
}

/// One waiter of `id` leaves; the last one takes its read state with it.
fn leave(waits: &mut Waits, key: &Arc<str>, id: i64) {
    let board = board(waits, key);
    if let Some(count) = board.waited.get_mut(&id) {
        *count -= 1;
        if *count == 0 {
            board.waited.remove(&id);
            board.read.remove(&id);
        }
    }
    if board.waited.is_empty() && !board.reading {
        waits.boards.remove(key);
    }
}

pub(crate) fn is_final(state: JobState) -> bool {
    matches!(
        state,
        JobState::Completed | JobState::Dead | JobState::Cancelled
    )
}

fn get(pool: &Pool, id: i64) -> Result<Job> {
    crate::jobs::get(&mut pool.get()?, id)?.ok_or(Error::NoSuchJob { id })
}

fn ended_job(pool: &Pool, job: Job) -> Result<Ended> {
    let result = if job.state == JobState::Completed {
        crate::jobs::result(&mut pool.get()?, job.id)?
    } else {
        None
    };
    Ok(Ended { job, result })
}

/// Of `ids`, those ended (with their state) and those gone (`None`: retention deleted them,
/// which it does only to ended jobs).
fn read_ended(pool: &Pool, ids: &[i64]) -> Result<Vec<(i64, Option<JobState>)>> {
    let mut conn = pool.get()?;
    let mut read = Vec::new();
    for chunk in ids.chunks(MAX_BATCH) {
        let rows: Vec<IdStateRow> = dispatch!(&mut *conn, c => {
            statement(STATES).bind_ids(chunk.iter().copied()).load::<IdStateRow>(c)
        })?;
        let mut found = HashSet::with_capacity(rows.len());
        for row in rows {
            found.insert(row.id);
            let state = JobState::parse(&row.state)?;
            if is_final(state) {
                read.push((row.id, Some(state)));
            }
        }
        read.extend(
            chunk
                .iter()
                .filter(|id| !found.contains(id))
                .map(|&id| (id, None)),
        );
    }
    Ok(read)
}

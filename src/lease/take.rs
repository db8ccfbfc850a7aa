//! Taking a lease: what a take asks for ([`Take`]), and waiting in line for it ([`Wait`]).
//!
//! A caller that waits joins the lease's line (`tenure_lease_waiters`) with a ticket from the
//! name's row, and is granted only when a slot is free and fewer waiters than free slots
//! stand before it; a [`Take`] without a wait (`try_take`) is granted only when more slots
//! are free than waiters wait. So pollers cannot overtake the line, and the line is served
//! first come, first served. A waiter renews its place at every attempt; one that gives up
//! leaves the line, one that dies loses its place once the place lapses (see
//! [`Wait::place_ttl`]).
//!
//! Waiters are woken when a holder releases: in this process at once (a condition variable),
//! from other processes by NOTIFY on PostgreSQL (the waiter LISTENs on its own connection
//! while it waits). Elsewhere, and for leases that lapse rather than being released, they
//! poll: every [`Wait::poll_interval`] at the longest.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant as Clock};

use diesel::prelude::*;
use diesel::sql_types::Text;

use super::Lease;
use super::grant::{Ask, Attempt, Line, attempt, leave_line};
use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch, lease_listen};
use crate::{Error, Result, TenureConnection, validate};

/// What a take asks for: a name, a ttl and a holder label, and optionally more holders, a
/// lock delay and a wait in line.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// use std::time::Duration;
/// use tenure::lease::{Take, Wait};
/// // At most 3 backups at once, across hosts; wait up to a minute in line for a turn.
/// let backups = Take::new("backups", Duration::from_secs(60), "host-a")
///     .holders(3)
///     .lock_delay(Duration::from_secs(5))
///     .wait(Wait::up_to(Duration::from_secs(60)));
/// let lease = backups.on(&mut conn)?.expect("nobody holds it yet");
/// assert_eq!(lease.slot(), 0);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Take {
    name: String,
    ttl: Duration,
    holder: String,
    holders: u32,
    lock_delay: Duration,
    wait: Option<Wait>,
    fast_takeover: bool,
    /// The key of the holder's liveness lock, set by a guard that took one.
    held_by: Option<i64>,
}

impl Take {
    /// A take of `name` for `ttl`, by `holder` (a label for humans): one holder at a time, no
    /// lock delay, no wait.
    pub fn new(name: &str, ttl: Duration, holder: &str) -> Take {
        Take {
            name: name.to_owned(),
            ttl,
            holder: holder.to_owned(),
            holders: 1,
            lock_delay: Duration::ZERO,
            wait: None,
            fast_takeover: true,
            held_by: None,
        }
    }

    /// Up to `holders` callers may hold the lease at once (a semaphore), 1 to
    /// [`MAX_HOLDERS`](super::MAX_HOLDERS). Each grant takes a slot of its own and a fence
    /// greater than every earlier grant's of the name. A name keeps one number while anyone
    /// holds it: a take asking for another fails with [`Error::LeaseHoldersMismatch`].
    pub fn holders(mut self, holders: u32) -> Take {
        self.holders = holders;
        self
    }

    /// After this grant lapses or is force-released (not after a clean release), its slot is
    /// granted again only once `delay` has passed too, by the database's clock: time for a
    /// paused holder's writes in flight to land before anyone else starts (Chubby's and
    /// Consul's lock-delay). Zero (the default) to 366 days.
    pub fn lock_delay(mut self, delay: Duration) -> Take {
        self.lock_delay = delay;
        self
    }

    /// Whether a [`LeaseGuard`](super::LeaseGuard) taken from a pool
    /// ([`LeaseGuard::take_pooled_as`](super::LeaseGuard::take_pooled_as) and the like, a
    /// [`Leadership`](super::Leadership)) holds a lock that ends with its process, so that
    /// its lease is taken over within seconds when the process dies, instead of at the end
    /// of the ttl (on by default). On PostgreSQL and MySQL/MariaDB it costs one connection
    /// per guard outside the pool, checked every second and opened again if its session
    /// ends; the price is that a guard that can reach neither that lock nor its lease for
    /// about 8 s (a database outage, a process stalled) counts its lease as lost, where
    /// without it the guard would keep the lease up to its ttl. On SQLite it is a file lock
    /// beside the database, with no such price. A lease taken
    /// without a guard, or by a guard on a connection you gave, has no such lock: its ttl
    /// alone ends it.
    ///
    /// ```
    /// # use std::time::Duration;
    /// use tenure::lease::Take;
    /// // One connection fewer per guard; a dead holder blocks others until its ttl.
    /// let take = Take::new("report", Duration::from_secs(30), "host-a").fast_takeover(false);
    /// # let _ = take;
    /// ```
    pub fn fast_takeover(mut self, on: bool) -> Take {
        self.fast_takeover = on;
        self
    }

    /// Whether guards of this take hold a liveness lock ([`Take::fast_takeover`]).
    pub(super) fn wants_holder_lock(&self) -> bool {
        self.fast_takeover
    }

    /// This take, granted with the key of the holder's liveness lock.
    pub(super) fn held_by(&self, key: Option<i64>) -> Take {
        Take {
            held_by: key,
            ..self.clone()
        }
    }

    /// Waits in line for the lease, up to `wait`'s timeout, instead of giving up at once.
    pub fn wait(mut self, wait: Wait) -> Take {
        self.wait = Some(wait);
        self
    }

    /// The lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ttl each grant and renewal asks for.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Takes the lease on `conn`, a bare connection: at once if a slot is free and nobody
    /// waits before this caller, else after waiting in line if [`Take::wait`] was given.
    /// `Ok(None)` if not granted (in time). Atomic: never more holders than
    /// [`Take::holders`].
    pub fn on<C: TenureConnection>(&self, conn: &mut C) -> Result<Option<Lease>> {
        Ok(self.timed(conn)?.map(|(lease, _)| lease))
    }

    /// [`Take::on`], also returning when the winning attempt was sent (for a guard's
    /// deadline).
    pub(super) fn timed<C: TenureConnection>(
        &self,
        conn: &mut C,
    ) -> Result<Option<(Lease, Clock)>> {
        self.timed_in_line(conn, &mut Line::Join, true)
    }

    /// [`Take::timed`] from the place `line` (a ticket an earlier wait kept, or
    /// [`Line::Join`]); a wait that times out keeps its place in `line` unless `leave` (a
    /// campaign waits in steps, and must not fall back to the end of the line between them).
    pub(super) fn timed_in_line<C: TenureConnection>(
        &self,
        conn: &mut C,
        line: &mut Line,
        leave: bool,
    ) -> Result<Option<(Lease, Clock)>> {
        validate::name("lease name", &self.name)?;
        validate::label("holder", &self.holder)?;
        let ttl_micros = validate::ttl(self.ttl)?;
        if self.holders == 0 || self.holders > super::MAX_HOLDERS {
            return Err(Error::invalid(
                "holders",
                format!("must be 1 to {}", super::MAX_HOLDERS),
            ));
        }
        let lock_delay_micros = if self.lock_delay.is_zero() {
            0
        } else {
            validate::ttl(self.lock_delay)?
        };
        let mut ask = Ask {
            name: &self.name,
            holder: &self.holder,
            holders: self.holders,
            ttl_micros,
            lock_delay_micros,
            line: Line::Outside,
            place_micros: 0,
            held_by: self.held_by,
        };
        let Some(wait) = self.wait else {
            let sent = Clock::now();
            return Ok(match attempt(conn, &ask)? {
                Attempt::Granted(lease) => Some((lease, sent)),
                Attempt::Busy(_) => None,
            });
        };
        if wait.poll_interval.is_zero() || wait.first_pause.is_zero() {
            return Err(Error::invalid(
                "poll interval",
                "the poll interval and the first pause must be longer than zero",
            ));
        }
        if wait.poll_interval > validate::MAX_TTL / 10 {
            return Err(Error::invalid(
                "poll interval",
                format!("must be at most {:?}", validate::MAX_TTL / 10),
            ));
        }
        ask.line = match *line {
            Line::At(ticket) => Line::At(ticket),
            Line::Outside | Line::Join => Line::Join,
        };
        ask.place_micros = validate::ttl(wait.place_ttl())?;
        let listening = lease_listen::listen(conn, true);
        let outcome = wait_in_line(conn, &mut ask, wait);
        if listening {
            lease_listen::listen(conn, false);
        }
        *line = match (&outcome, ask.line) {
            (Ok(None), Line::At(ticket)) if !leave => Line::At(ticket),
            _ => Line::Join,
        };
        if leave || outcome.is_err() {
            self.leave(conn, ask.line);
        }
        outcome
    }

    /// Gives up a place in line (a waiter that stopped waiting), so that those behind need not
    /// wait for it to lapse. If this fails, the place lapses on its own.
    pub(super) fn leave<C: TenureConnection>(&self, conn: &mut C, line: Line) {
        if let Line::At(ticket) = line {
            if leave_line(conn, &self.name, ticket).is_ok() {
                wake_waiters();
            }
        }
    }
}

fn wait_in_line<C: TenureConnection>(
    conn: &mut C,
    ask: &mut Ask<'_>,
    wait: Wait,
) -> Result<Option<(Lease, Clock)>> {
    // A timeout past what the clock can hold: no deadline (wait for good).
    let deadline = Clock::now().checked_add(wait.timeout);
    let mut backoff = wait.poll_interval.min(wait.first_pause);
    loop {
        let sent = Clock::now();
        // Read before the attempt, so that a release between the attempt and the wait below
        // is not missed.
        let seen = generation();
        match attempt(conn, ask) {
            Ok(Attempt::Granted(lease)) => {
                ask.line = Line::Outside;
                return Ok(Some((lease, sent)));
            }
            Ok(Attempt::Busy(line)) => ask.line = line,
            Err(e) if e.is_retryable() => {}
            Err(e) => return Err(e),
        }
        let now = Clock::now();
        let passed = deadline.is_some_and(|deadline| now >= deadline);
        if passed || wait.cancelled.is_some_and(|cancelled| cancelled()) {
            return Ok(None);
        }
        // Uniform in [backoff/2, backoff], so waiters do not poll in step.
        let pause = backoff.mul_f64(rand::random_range(0.5..=1.0));
        let left = deadline.map_or(pause, |deadline| deadline - now);
        sleep_until_woken(conn, ask.name, seen, now + pause.min(left));
        backoff = (backoff * 2).min(wait.poll_interval);
    }
}

/// How long [`Take::wait`] waits, and how often it asks.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    pub(super) timeout: Duration,
    pub(super) poll_interval: Duration,
    first_pause: Duration,
    cancelled: Option<fn() -> bool>,
}

impl Wait {
    /// Wait up to `timeout`, asking at most every 100 ms once the backoff has grown (and at
    /// once when a holder releases in this process, or on PostgreSQL in any).
    pub fn up_to(timeout: Duration) -> Wait {
        Wait {
            timeout,
            poll_interval: Duration::from_millis(100),
            first_pause: Duration::from_millis(10),
            cancelled: None,
        }
    }

    /// The longest pause between two attempts (default 100 ms): after a lease lapses, or a
    /// holder releases in another process on SQLite or MySQL, the waiter at the head of the
    /// line is granted within about this long.
    pub fn poll_interval(mut self, poll_interval: Duration) -> Wait {
        self.poll_interval = poll_interval;
        self
    }

    /// The pause after the first attempt (default 10 ms); each pause doubles, up to the poll
    /// interval. Where releases wake waiters (in one process; on PostgreSQL in any), a long
    /// first pause and poll interval cost only the wait for a lease that lapses unreleased.
    pub fn first_pause(mut self, first_pause: Duration) -> Wait {
        self.first_pause = first_pause;
        self
    }

    /// Gives up waiting (as if the timeout passed) once `cancelled` returns true; it is asked
    /// after every attempt, so at least every poll interval. For a program that waits for a
    /// signal's flag, say.
    pub fn cancel_when(mut self, cancelled: fn() -> bool) -> Wait {
        self.cancelled = Some(cancelled);
        self
    }

    /// How long a waiter's place in line lasts unless it renews it (each attempt does): the
    /// larger of 5 s and 10 poll intervals. A waiter that died stops renewing, so those behind
    /// it wait at most this long for it.
    pub fn place_ttl(&self) -> Duration {
        self.poll_interval
            .saturating_mul(10)
            .max(Duration::from_secs(5))
    }
}

/// Releases in this process, counted, so that a waiter can tell one happened since it looked.
static RELEASES: Mutex<u64> = Mutex::new(0);
static RELEASED: Condvar = Condvar::new();

fn generation() -> u64 {
    *RELEASES.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Wakes this process's waiters (after a release, or a waiter leaving the line): each makes
/// an attempt at once.
pub(super) fn wake_waiters() {
    let mut releases = RELEASES.lock().unwrap_or_else(PoisonError::into_inner);
    *releases = releases.wrapping_add(1);
    RELEASED.notify_all();
}

/// In a release's transaction: wakes the lease's waiters in other processes where the
/// backend can (PostgreSQL NOTIFY, delivered at commit).
pub(super) fn notify_released<D: Dialect + TenureConnection>(c: &mut D, name: &str) -> Result<()> {
    if let Some(sql) = c.syntax().notify_lease {
        dispatch!(c, c => statement(sql).bind::<Text, _>(name).execute(c))?;
    }
    Ok(())
}

/// How often a waiter on PostgreSQL looks for a notification while it sleeps.
const NOTIFICATION_POLL: Duration = Duration::from_millis(5);

/// Sleeps until `until`, or until a release in this process (one since `seen`), or a
/// notification that `name` was released.
fn sleep_until_woken<C: TenureConnection>(conn: &mut C, name: &str, seen: u64, until: Clock) {
    let postgres = lease_listen::can_listen(conn);
    loop {
        {
            let releases = RELEASES.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Clock::now();
            if *releases != seen || now >= until {
                return;
            }
            let step = if postgres {
                NOTIFICATION_POLL.min(until - now)
            } else {
                until - now
            };
            let (releases, _) = RELEASED
                .wait_timeout(releases, step)
                .unwrap_or_else(PoisonError::into_inner);
            if *releases != seen {
                return;
            }
        }
        if postgres && lease_listen::released(conn, name) {
            return;
        }
    }
}

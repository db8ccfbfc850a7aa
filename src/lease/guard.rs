//! A lease held for as long as a value lives: renewed from a background thread, released on
//! drop.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant as Clock};

use super::grant::Line;
use super::liveness::{ALIVE_FOR, HolderLock};
use super::renewal::{Reconnect, Renewal, Shared, State, check_until_stopped, margin, reconnect};
use super::{Lease, Take, Wait};
use crate::{Error, Pool, Result, TenureConnection};

/// How long [`LeaseGuard::release`] (and drop) wait for the release to be done before saying
/// [`Error::LeaseReleasePending`].
pub const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Holds a lease for as long as it lives.
///
/// It takes the lease on a connection of its own (never inside a caller's transaction),
/// renews it from a background thread every ttl/3, and releases it on drop. Meanwhile
/// [`LeaseGuard::is_held`] says whether the work may go on, and [`LeaseGuard::wait_lost`]
/// blocks until it may not.
///
/// The guard treats the lease as lost at a local, monotonic deadline: the time the last
/// successful take or renewal was *sent*, plus the ttl, minus a margin of ttl/10. So it says
/// "lost" no later than the database would, even when the database cannot be reached and a
/// renewal hangs. Once lost or released it never renews again.
///
/// A guard taken from a pool also holds a lock that ends with its process
/// ([`Take::fast_takeover`]): when the process dies, another takes the lease over within
/// seconds. On a server it checks that lock every second and takes it again on a new
/// connection if its session ended (then renews at once); it counts the lease as lost when
/// for 8 s neither a renewal succeeded nor a check found the lock held (before anyone else
/// can be granted the lease).
///
/// ## Releasing inside a transaction
///
/// [`Lease::verify`] locks the lease's row until the caller's transaction ends, and the guard
/// renews and releases on its own connection, which must wait for that lock. So inside a
/// transaction that ran `guard.lease().verify(conn)`, release with
/// [`LeaseGuard::release_on`]`(conn)`: the release then commits with the work. There,
/// [`LeaseGuard::release`] (or dropping the guard) cannot finish before the transaction does:
/// it returns [`Error::LeaseReleasePending`] after [`RELEASE_WAIT`] instead of waiting for
/// itself forever, and the release completes on its own once the transaction ends.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("app.db").display().to_string();
/// use std::time::Duration;
/// let pool = tenure::Pool::open(&url)?;
/// tenure::run_migrations(&mut pool.get()?)?;
///
/// if let Some(guard) = tenure::LeaseGuard::try_take(pool.get()?, "nightly-report", Duration::from_secs(30), "host-a")? {
///     for _chunk in 0..3 {
///         if !guard.is_held() { break; } // lost: stop working
///         // ... one chunk of the work, tagged with guard.fence() ...
///     }
/// } // dropped: renewals stop and the lease is released
/// # Ok(()) }
/// ```
pub struct LeaseGuard {
    lease: Lease,
    shared: Arc<Shared>,
    renewer: Option<Renewer>,
    /// A liveness lock that needs no checks (a lock file on SQLite): removed once the guard
    /// stopped, on the caller's thread (a process may exit right after a release).
    file_lock: Option<HolderLock>,
}

/// The renewal thread, and where it reports the outcome of its final release.
struct Renewer {
    thread: JoinHandle<()>,
    released: Receiver<Result<bool>>,
}

/// [`LeaseGuard::is_held`] for another thread than the guard's owner.
#[derive(Clone)]
pub(super) struct HeldView(Arc<Shared>);

impl HeldView {
    pub(super) fn is_held(&self) -> bool {
        !self.0.lock().check_deadline(Clock::now())
    }
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("name", &self.lease.name)
            .field("fence", &self.lease.fence)
            .field("held", &self.is_held())
            .finish()
    }
}

impl LeaseGuard {
    /// Takes the lease on `conn` (which the guard keeps, for its renewals) if it is free; see
    /// [`super::try_take`]. `Ok(None)` if someone holds it.
    pub fn try_take<C>(conn: C, name: &str, ttl: Duration, holder: &str) -> Result<Option<Self>>
    where
        C: TenureConnection + 'static,
    {
        Self::take_on(conn, &Take::new(name, ttl, holder))
    }

    /// Like [`LeaseGuard::try_take`] on a connection of `pool`; when a renewal fails for a
    /// reason other than loss (the connection broke, the database restarted), the next one
    /// uses a fresh connection from the pool. So the guard keeps a lease through a database
    /// restart shorter than its ttl, and says "lost" only when it could not renew in time.
    /// A guard from a pool also holds a liveness lock ([`Take::fast_takeover`], on by
    /// default): then the outage it keeps its lease through is about 8 s at most.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("app.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// use std::time::Duration;
    /// let guard = tenure::LeaseGuard::try_take_pooled(&pool, "backup", Duration::from_secs(30), "host-a")?;
    /// assert!(guard.is_some_and(|g| g.is_held()));
    /// # Ok(()) }
    /// ```
    pub fn try_take_pooled(
        pool: &Pool,
        name: &str,
        ttl: Duration,
        holder: &str,
    ) -> Result<Option<Self>> {
        Self::take_pooled_as(pool, &Take::new(name, ttl, holder))
    }

    /// Like [`LeaseGuard::try_take_pooled`], waiting for the lease as [`super::take`] does.
    pub fn take_pooled(
        pool: &Pool,
        name: &str,
        ttl: Duration,
        holder: &str,
        wait: Wait,
    ) -> Result<Option<Self>> {
        Self::take_pooled_as(pool, &Take::new(name, ttl, holder).wait(wait))
    }

    /// Like [`LeaseGuard::try_take`], waiting for the lease as [`super::take`] does.
    pub fn take<C>(
        conn: C,
        name: &str,
        ttl: Duration,
        holder: &str,
        wait: Wait,
    ) -> Result<Option<Self>>
    where
        C: TenureConnection + 'static,
    {
        Self::take_on(conn, &Take::new(name, ttl, holder).wait(wait))
    }

    /// Takes the lease as `take` asks (more holders, a lock delay, a wait in line) on a
    /// connection of `pool`, and holds it as [`LeaseGuard::try_take_pooled`] does.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("app.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// use std::time::Duration;
    /// use tenure::lease::{Take, Wait};
    /// let take = Take::new("backups", Duration::from_secs(30), "host-a")
    ///     .holders(3)
    ///     .wait(Wait::up_to(Duration::from_secs(10)));
    /// let first = tenure::LeaseGuard::take_pooled_as(&pool, &take)?.unwrap();
    /// let second = tenure::LeaseGuard::take_pooled_as(&pool, &take)?.unwrap();
    /// assert!(second.fence() > first.fence());
    /// # Ok(()) }
    /// ```
    pub fn take_pooled_as(pool: &Pool, take: &Take) -> Result<Option<Self>> {
        Self::take_pooled_from(pool, take, &mut Line::Join, true, &mut None)
    }

    /// [`LeaseGuard::take_pooled_as`] from the place `line` in the lease's line, keeping the
    /// place there if the wait times out unless `leave` (a campaign's steps keep it), and
    /// the liveness lock in `holder_lock` for the next step if not granted.
    pub(super) fn take_pooled_from(
        pool: &Pool,
        take: &Take,
        line: &mut Line,
        leave: bool,
        holder_lock: &mut Option<HolderLock>,
    ) -> Result<Option<Self>> {
        // One kept from an earlier step may have lost its session meanwhile: a grant with it
        // would be lost at its first check.
        if holder_lock
            .as_mut()
            .is_some_and(|lock| !matches!(lock.check(), Ok(true)))
        {
            *holder_lock = None;
        }
        if take.wants_holder_lock() && holder_lock.is_none() {
            *holder_lock = HolderLock::take(pool)?;
        }
        let take = take.held_by(holder_lock.as_ref().map(HolderLock::key));
        let mut conn = pool.get()?;
        let Some((lease, sent)) = take.timed_in_line(&mut conn, line, leave)? else {
            return Ok(None);
        };
        let reconnect = Some(reconnect(pool));
        Ok(Some(Self::start(
            conn,
            reconnect,
            lease,
            take.ttl(),
            sent,
            holder_lock.take(),
        )))
    }

    /// Takes the lease as `take` asks on `conn` (which the guard keeps, for its renewals),
    /// and holds it as [`LeaseGuard::try_take`] does.
    pub fn take_on<C>(mut conn: C, take: &Take) -> Result<Option<Self>>
    where
        C: TenureConnection + 'static,
    {
        let ttl = take.ttl();
        Ok(take
            .timed(&mut conn)?
            .map(|(lease, sent)| Self::start(conn, None, lease, ttl, sent, None)))
    }

    fn start<C>(
        conn: C,
        reconnect: Option<Reconnect<C>>,
        lease: Lease,
        ttl: Duration,
        sent: Clock,
        holder_lock: Option<HolderLock>,
    ) -> Self
    where
        C: TenureConnection + 'static,
    {
        let checks = holder_lock.as_ref().is_some_and(HolderLock::needs_checks);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(
                &lease.name,
                sent + ttl - margin(ttl),
                checks.then_some(sent + ALIVE_FOR),
            )),
            changed: Condvar::new(),
        });
        // A session lock is checked on a thread of its own; a lock file stays with the guard.
        let (checked, file_lock) = match holder_lock {
            Some(lock) if checks => (Some(lock), None),
            other => (None, other),
        };
        if let Some(lock) = checked {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("tenure-lease-check-{}", lease.fence))
                .spawn(move || check_until_stopped(lock, &shared));
            if let Err(e) = spawned {
                // No checks: only renewals move the liveness deadline, so the guard says
                // "lost" sooner, never later.
                tracing::warn!(lease = %lease.name, error = %e, "could not start the liveness check thread");
            }
        }
        let (report, released) = mpsc::channel();
        let renewer = {
            let (lease, shared) = (lease.clone(), shared.clone());
            std::thread::Builder::new()
                .name(format!("tenure-lease-{}", lease.fence))
                .spawn(move || {
                    let mut renewal = Renewal {
                        conn,
                        reconnect,
                        lease,
                        ttl,
                    };
                    let outcome = renewal.until_stopped(&shared);
                    // The guard may have stopped waiting (see `RELEASE_WAIT`).
                    let _ = report.send(outcome);
                })
        };
        match renewer {
            Ok(thread) => LeaseGuard {
                lease,
                shared,
                renewer: Some(Renewer { thread, released }),
                file_lock,
            },
            // No thread, no renewals: the guard holds the lease until its first deadline
            // and then reports it lost; the row expires on its own.
            Err(e) => {
                tracing::warn!(lease = %lease.name, error = %e, "could not start the renewal thread");
                LeaseGuard {
                    lease,
                    shared,
                    renewer: None,
                    file_lock,
                }
            }
        }
    }

    /// The grant: name, fence and token.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The fence of this grant (see [`Lease::fence`]).
    pub fn fence(&self) -> i64 {
        self.lease.fence
    }

    /// Whether the lease is still held: not reported lost by the database, and the local
    /// deadline has not passed.
    pub fn is_held(&self) -> bool {
        !self.shared.lock().check_deadline(Clock::now())
    }

    /// What another thread may read of the guard: whether it is held.
    pub(super) fn held_view(&self) -> HeldView {
        HeldView(self.shared.clone())
    }

    /// The local monotonic instant until which the lease is surely held: the deadline
    /// [`LeaseGuard::is_held`] checks (when the last successful take or renewal was sent, plus
    /// the ttl, minus ttl/10); `None` once the lease is lost. It moves later with each
    /// renewal. For work that must end by then even if this process cannot say so: `tenure
    /// lease run` hands it to a watchdog process that stops the command when it passes.
    pub fn held_until(&self) -> Option<Clock> {
        let mut state = self.shared.lock();
        (!state.check_deadline(Clock::now())).then_some(state.deadline())
    }

    /// Blocks until the lease is lost or `timeout` passes; returns whether it was lost.
    pub fn wait_lost(&self, timeout: Duration) -> bool {
        // A timeout past what the clock can hold waits until the loss.
        let until = Clock::now().checked_add(timeout);
        let mut state = self.shared.lock();
        loop {
            let now = Clock::now();
            if state.check_deadline(now) {
                return true;
            }
            if until.is_some_and(|until| now >= until) {
                return false;
            }
            let deadline = state.deadline();
            let wake = until.map_or(deadline, |until| deadline.min(until)) - now;
            state = self
                .shared
                .changed
                .wait_timeout(state, wake)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Stops renewing and releases the lease on the guard's own connection; returns whether
    /// it was still this guard's to release. Dropping the guard does the same and ignores the
    /// outcome.
    ///
    /// Waits at most [`RELEASE_WAIT`] for the release: when the lease's row stays locked
    /// longer, by a transaction that ran [`Lease::verify`] (typically the caller's own, on
    /// this thread: use [`LeaseGuard::release_on`] there), it returns
    /// [`Error::LeaseReleasePending`] and the release goes on in the background until that
    /// transaction ends, or until the lease lapses (it is renewed no more).
    pub fn release(mut self) -> Result<bool> {
        self.stop(true)
    }

    /// Stops renewing and releases the lease through `conn`, inside its open transaction if
    /// there is one (in a savepoint; on a bare connection it commits on its own). After
    /// `guard.lease().verify(conn)` this is the way to release inside the transaction: the
    /// release commits with the work, and nothing waits for the row lock the transaction
    /// holds. If that transaction rolls back, so does the release: the lease then lapses at
    /// the end of its ttl (the guard renews it no more). Returns whether it was still this
    /// guard's to release.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("app.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// use std::time::Duration;
    /// let guard = tenure::LeaseGuard::try_take_pooled(&pool, "sync", Duration::from_secs(30), "me")?
    ///     .expect("free");
    /// let mut conn = pool.get()?;
    /// let released = tenure::transaction(&mut conn, |conn| {
    ///     guard.lease().verify(conn)?;
    ///     // ... write the results of the work here ...
    ///     guard.release_on(conn)
    /// })?;
    /// assert!(released);
    /// # Ok(()) }
    /// ```
    pub fn release_on<C: TenureConnection>(mut self, conn: &mut C) -> Result<bool> {
        {
            let mut state = self.shared.lock();
            state.stop = true;
            state.lost = true;
            state.release = false;
        }
        self.shared.changed.notify_all();
        // Not joined: the thread may be inside a renewal that waits for the row lock `conn`'s
        // transaction holds. Stopped, it exits without touching the lease again (a renewal
        // that lands after this release finds another token, and changes nothing).
        self.renewer = None;
        let released = self.lease.release_joining(conn);
        self.file_lock = None;
        released
    }

    fn stop(&mut self, release: bool) -> Result<bool> {
        {
            let mut state = self.shared.lock();
            state.stop = true;
            state.lost = true;
            state.release = release;
        }
        self.shared.changed.notify_all();
        let Some(renewer) = self.renewer.take() else {
            self.file_lock = None;
            return Ok(false);
        };
        // Never wait for the thread unboundedly: its release may wait for a row lock that
        // this very thread's open transaction holds.
        let outcome = match renewer.released.recv_timeout(RELEASE_WAIT) {
            Ok(outcome) => {
                let _ = renewer.thread.join();
                outcome
            }
            // The thread panicked: no release was made.
            Err(RecvTimeoutError::Disconnected) => Ok(false),
            Err(RecvTimeoutError::Timeout) => Err(Error::LeaseReleasePending {
                name: self.lease.name.clone(),
            }),
        };
        // After the release (or once it is pending: the guard counts the lease as lost).
        self.file_lock = None;
        outcome
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.renewer.is_some()
            && let Err(e) = self.stop(true)
        {
            tracing::warn!(lease = %self.lease.name, error = %e, "releasing a lease on drop failed; it will expire");
        }
    }
}

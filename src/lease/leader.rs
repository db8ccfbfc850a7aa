//! Leader election on a lease: campaign until elected, lead while the lease is held, campaign
//! again after losing it ([`Leadership`]); and who leads now ([`leader`]).

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant as Clock};

use super::grant::Line;
use super::guard::HeldView;
use super::{Lease, LeaseGuard, LeaseInfo, Take, Wait, holders};
use crate::{Pool, Result, TenureConnection, validate};

/// How long one wait in line lasts before the campaign looks whether it should stop (and so
/// the longest [`Leadership::resign`] or a drop waits for a candidate that is not leading).
const CAMPAIGN_STEP: Duration = Duration::from_millis(500);

/// What changed in this candidate's leadership, as [`Leadership::changes`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeadershipChange {
    /// Elected: this candidate leads, with the lease's fence for this term.
    Elected {
        /// The fence of the grant: greater than every earlier leader's.
        fence: i64,
    },
    /// No longer leads (lost the lease, or resigned).
    Lost {
        /// The fence of the term that ended.
        fence: i64,
    },
}

/// A candidate for leadership of `name`: a background thread campaigns (waits in line for the
/// lease `name`, one holder), holds it while it leads (a [`LeaseGuard`] renews it), and
/// campaigns again after losing it, until [`Leadership::resign`] or drop.
///
/// At most one candidate leads at a time by the database's clock, and each term has a fence
/// greater than the one before: pass [`Leadership::fence`] with the leader's writes so that a
/// store can refuse a deposed leader's. [`Leadership::is_leader`] turns false no later than
/// the lease could pass to another (the guard's local deadline).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = tenure::Pool::open(&dir.path().join("app.db").display().to_string())?;
/// # tenure::run_migrations(&mut pool.get()?)?;
/// use std::time::Duration;
/// use tenure::lease::{self, Leadership};
/// let me = Leadership::campaign(&pool, "scheduler", Duration::from_secs(10), "host-a", Some("10.0.0.7"))?;
/// assert!(me.wait_elected(Duration::from_secs(10)));
/// let leader = lease::leader(&mut pool.get()?, "scheduler")?.unwrap();
/// assert_eq!((leader.holder.as_str(), leader.value.as_deref()), ("host-a", Some("10.0.0.7")));
/// me.resign();
/// # Ok(()) }
/// ```
pub struct Leadership {
    name: String,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The current term's grant and its guard's view, while leading.
    term: Option<(Lease, HeldView)>,
    stop: bool,
    subscribers: Vec<Sender<LeadershipChange>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a change and tells the subscribers that still listen.
    fn change(&self, term: Option<(Lease, HeldView)>, change: LeadershipChange) {
        let mut state = self.lock();
        state.term = term;
        state.subscribers.retain(|s| s.send(change).is_ok());
        self.changed.notify_all();
    }
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.name)
            .field("leading", &self.is_leader())
            .finish()
    }
}

impl Leadership {
    /// Starts campaigning for `name` on connections of `pool`, holding the lease for `ttl` at
    /// a time (renewed every ttl/3 while leading) as `holder`, publishing `value` (the
    /// leader's address, say) with each term: [`leader`] shows it to everyone. Returns at once;
    /// see [`Leadership::wait_elected`].
    pub fn campaign(
        pool: &Pool,
        name: &str,
        ttl: Duration,
        holder: &str,
        value: Option<&str>,
    ) -> Result<Leadership> {
        validate::name("lease name", name)?;
        validate::label("holder", holder)?;
        validate::ttl(ttl)?;
        if let Some(value) = value {
            validate::text("lease value", value, super::MAX_VALUE_BYTES)?;
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        // A lock delay of one ttl: a leader that was force-released (or lapsed) learns it at
        // its next renewal, or at its guard's local deadline at the latest (0.9 ttl after its
        // last renewal), before anyone else can be elected.
        let take = Take::new(name, ttl, holder)
            .lock_delay(ttl)
            .wait(Wait::up_to(CAMPAIGN_STEP));
        let (pool, value, campaign) = (pool.clone(), value.map(str::to_owned), shared.clone());
        let thread = std::thread::Builder::new()
            .name(format!("tenure-leader-{name}"))
            .spawn(move || run(&pool, &take, value.as_deref(), &campaign))
            .map_err(|e| {
                crate::Error::invalid("campaign", format!("cannot start its thread: {e}"))
            })?;
        Ok(Leadership {
            name: name.to_owned(),
            shared,
            thread: Some(thread),
        })
    }

    /// Whether this candidate leads now: elected, and its lease not lost by the guard's local
    /// deadline.
    pub fn is_leader(&self) -> bool {
        self.fence().is_some()
    }

    /// This term's fence while this candidate leads; `None` otherwise.
    pub fn fence(&self) -> Option<i64> {
        let state = self.shared.lock();
        state
            .term
            .as_ref()
            .filter(|(_, held)| held.is_held())
            .map(|(lease, _)| lease.fence())
    }

    /// Inside the caller's transaction: checks that this candidate still leads and locks its
    /// term's lease until the transaction ends ([`Lease::verify`]), so that the leader's
    /// writes in the same transaction commit only while it leads. [`crate::Error::LeaseLost`]
    /// when it does not (return it from the transaction to roll the work back).
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let pool = tenure::Pool::open(&dir.path().join("app.db").display().to_string())?;
    /// # tenure::run_migrations(&mut pool.get()?)?;
    /// # use std::time::Duration;
    /// let me = tenure::lease::Leadership::campaign(&pool, "scheduler", Duration::from_secs(10), "host-a", None)?;
    /// if me.wait_elected(Duration::from_secs(10)) {
    ///     tenure::transaction(&mut pool.get()?, |conn| {
    ///         me.verify(conn)?;
    ///         // ... the leader's writes ...
    ///         Ok::<_, tenure::Error>(())
    ///     })?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn verify<C: TenureConnection>(&self, conn: &mut C) -> Result<()> {
        let term = {
            let state = self.shared.lock();
            state
                .term
                .as_ref()
                .filter(|(_, held)| held.is_held())
                .map(|(lease, _)| lease.clone())
        };
        match term {
            Some(lease) => lease.verify(conn),
            None => Err(crate::Error::LeaseLost {
                name: self.name.clone(),
            }),
        }
    }

    /// Blocks until this candidate leads, up to `timeout`; whether it does.
    pub fn wait_elected(&self, timeout: Duration) -> bool {
        // No deadline for a timeout past what the clock can hold: wait for good.
        let deadline = Clock::now().checked_add(timeout);
        let mut state = self.shared.lock();
        loop {
            if state.term.as_ref().is_some_and(|(_, held)| held.is_held()) {
                return true;
            }
            let now = Clock::now();
            if deadline.is_some_and(|d| now >= d) || state.stop {
                return false;
            }
            // Wakes on a change, and every 50 ms (a term may end by its deadline alone).
            let left = deadline.map_or(Duration::MAX, |d| d - now);
            let step = left.min(Duration::from_millis(50));
            state = self
                .shared
                .changed
                .wait_timeout(state, step)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The changes of this candidate's leadership from now on, in order; first `Elected`
    /// with the current term's fence if a term is under way (so that every `Lost` follows its
    /// `Elected`, also for a term that began before this call).
    pub fn changes(&self) -> Receiver<LeadershipChange> {
        let (sender, receiver) = mpsc::channel();
        let mut state = self.shared.lock();
        if let Some((lease, _)) = &state.term {
            let _ = sender.send(LeadershipChange::Elected {
                fence: lease.fence(),
            });
        }
        state.subscribers.push(sender);
        receiver
    }

    /// Stops campaigning and, if leading, releases the lease (so another candidate is elected
    /// at once). Waits for the campaign's thread: up to about half a second when not leading.
    pub fn resign(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.stop();
    }
}

fn stopping(shared: &Shared) -> bool {
    shared.lock().stop
}

/// Sleeps `pause`, or less if the campaign is stopped meanwhile.
fn pause_unless_stopped(shared: &Shared, pause: Duration) {
    let until = Clock::now() + pause;
    let mut state = shared.lock();
    while !state.stop {
        let now = Clock::now();
        if now >= until {
            return;
        }
        state = shared
            .changed
            .wait_timeout(state, until - now)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

/// The campaign: wait in line, lead while held, again.
fn run(pool: &Pool, take: &Take, value: Option<&str>, shared: &Shared) {
    let mut pause = Duration::from_millis(100);
    // The campaign's place in line, kept from one step of its wait to the next.
    let mut line = Line::Join;
    // The campaign's liveness lock (fast takeover), kept from one step to the next until a
    // grant takes it.
    let mut holder_lock = None;
    while !stopping(shared) {
        let guard = match LeaseGuard::take_pooled_from(
            pool,
            take,
            &mut line,
            false,
            &mut holder_lock,
        ) {
            Ok(Some(guard)) => guard,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(target: "tenure::lease", lease = take.name(), error = %e, "campaign: taking the lease failed");
                pause_unless_stopped(shared, pause);
                pause = (pause * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        pause = Duration::from_millis(100);
        if let Some(value) = value {
            let published = pool
                .get()
                .and_then(|mut conn| guard.lease().set_value(&mut conn, Some(value)));
            if let Err(e) = published {
                // Leading without the value would mislead those who read it: give it up.
                tracing::warn!(target: "tenure::lease", lease = take.name(), error = %e, "campaign: publishing the value failed");
                let _ = guard.release();
                continue;
            }
        }
        let fence = guard.fence();
        shared.change(
            Some((guard.lease().clone(), guard.held_view())),
            LeadershipChange::Elected { fence },
        );
        while !stopping(shared) && !guard.wait_lost(Duration::from_millis(100)) {}
        shared.change(None, LeadershipChange::Lost { fence });
        if let Err(e) = guard.release() {
            tracing::warn!(target: "tenure::lease", lease = take.name(), error = %e, "campaign: releasing the lease failed");
        }
    }
    // Stopped while in line: leave it (else the place lapses on its own).
    if let Ok(mut conn) = pool.get() {
        take.leave(&mut conn, line);
    }
}

/// Who leads `name` now: its holder (label, fence, value, expiry), or `None` when nobody
/// holds it (by the database's clock).
pub fn leader<C: TenureConnection>(conn: &mut C, name: &str) -> Result<Option<LeaseInfo>> {
    Ok(holders(conn, name)?.into_iter().find(|info| info.held))
}

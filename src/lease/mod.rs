//! Leases: named, time-limited, token-owned locks in a table (`tenure_leases`), of one holder
//! or of N ([`Take::holders`]: a semaphore).
//!
//! A lease is held by whoever holds its current token, until its expiry by the database's
//! clock. Taking one is atomic on every backend: of any number of concurrent callers at most
//! the free slots' number win (one, for a lease of one holder), and none gets an error.
//! Callers that wait ([`take`], [`Take::wait`]) stand in line and are served first come,
//! first served; a release wakes them (at once in its process, by NOTIFY on PostgreSQL). A
//! [`Take::lock_delay`] keeps a lapsed holder's slot free for a while; a holder can publish a
//! value with its grant ([`Lease::set_value`]); [`Leadership`] elects a leader on a lease. A
//! [`LeaseGuard`] taken from a pool holds a lock that ends with its process, so when its
//! process dies another takes the lease over within seconds, not at the end of the ttl
//! ([`Take::fast_takeover`]). The design (tables, the grant's transaction, wake-ups, fast
//! takeover) is in `docs/leases.md`. Each grant has a fresh random token and a *fence*, a
//! number strictly greater than every fence granted before for that name (rows are never
//! deleted, so fences never go back): pass it along with the work so that whatever the work
//! writes to can refuse a stale holder.
//!
//! | operation | connection | what it does |
//! |---|---|---|
//! | [`try_take`] / [`take`] / [`Take::on`] | bare | grant a free slot if nobody waits before; `take` waits in line |
//! | [`Lease::renew`] | bare | expiry = database now + ttl, if still held and not lapsed |
//! | [`Lease::release`] | bare | clears the token if still ours; idempotent |
//! | [`Lease::verify`] | caller's transaction | locks the row and checks token and expiry |
//! | [`force_release`] | bare | operators: clears whoever's token |
//! | [`Lease::set_value`] | any | publishes a value, if still held |
//! | [`inspect`] / [`holders`] / [`list`] / [`leader`] | any | holders, fences, times, values and the database's now |
//!
//! [`LeaseGuard`] does the common case: take, renew from a background thread, release on
//! drop; [`LeaseGuard::release_on`] releases through the caller's connection, inside its
//! transaction (the one way to release inside a transaction that ran [`Lease::verify`]).
//!
//! ```
//! # fn main() -> Result<(), tenure::Error> {
//! use std::time::Duration;
//! use tenure::lease;
//! let mut conn = tenure::AnyConnection::connect(":memory:")?;
//! tenure::run_migrations(&mut conn)?;
//!
//! let mut backup = lease::try_take(&mut conn, "nightly-backup", Duration::from_secs(60), "host-a")?
//!     .expect("nobody holds it yet");
//! assert!(lease::try_take(&mut conn, "nightly-backup", Duration::from_secs(60), "host-b")?.is_none());
//! backup.renew(&mut conn, Duration::from_secs(60))?;
//! assert!(backup.release(&mut conn)?);
//! let next = lease::try_take(&mut conn, "nightly-backup", Duration::from_secs(60), "host-b")?.unwrap();
//! assert!(next.fence() > backup.fence());
//! # Ok(()) }
//! ```

mod grant;
mod guard;
mod leader;
mod liveness;
mod renewal;
mod take;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use uuid::Uuid;

use crate::backend::statement::statement;
use crate::backend::transaction::bare_write_transaction;
use crate::backend::{Dialect, dispatch};
use crate::sql_types::{DatabaseNow, Token};
use crate::{Error, Result, TenureConnection, validate};

pub use guard::{LeaseGuard, RELEASE_WAIT};
pub use leader::{Leadership, LeadershipChange, leader};
pub use take::{Take, Wait};

/// The longest value a holder can publish with its lease ([`Lease::set_value`]), in bytes.
pub const MAX_VALUE_BYTES: usize = 65_535;

/// The most holders a lease can have at once.
pub const MAX_HOLDERS: u32 = 1_000;

/// Only the current token, and only while not lapsed: a renewal after the lease lapsed says
/// "lost" even if nobody took it over. The second `{now+ttl}` is when the slot may be granted
/// again should this holder lapse (the expiry plus its lock delay).
const RENEW: &str = "\
    UPDATE tenure_leases SET expires_at = {now+ttl}, reusable_at = {now+ttl} \
    WHERE name = ? AND slot = ? AND token = ? AND expires_at > {now}";

/// Clears the token; the row and its fence stay. A released lease's expiry becomes the
/// release time (if that is earlier). Released before it lapsed, its slot is free at once (a
/// clean release needs no lock delay); released after, the lock delay runs on: the holder
/// may have written after its lease lapsed. `reusable_at` comes first: MySQL's later
/// assignments see the earlier ones' new values.
const RELEASE: &str = "\
    UPDATE tenure_leases SET token = NULL, \
        reusable_at = CASE WHEN expires_at > {now} THEN {now} ELSE reusable_at END, \
        expires_at = CASE WHEN expires_at > {now} THEN {now} ELSE expires_at END \
    WHERE name = ? AND slot = ? AND token = ?";

/// An operator's release of one holder: its slot waits out the holder's lock delay (the
/// `{now+ttl}`), since the holder may still be writing.
const FORCE_RELEASE: &str = "\
    UPDATE tenure_leases SET token = NULL, \
        expires_at = CASE WHEN expires_at > {now} THEN {now} ELSE expires_at END, \
        reusable_at = {now+ttl} \
    WHERE name = ? AND slot = ? AND token = ?";

/// A write that changes nothing but takes the row's write lock in the caller's transaction
/// (on SQLite, the database's write lock), so the lease cannot change hands before it
/// commits. It matches only while the token is ours and the lease has not lapsed.
const VERIFY: &str = "\
    UPDATE tenure_leases SET fence = fence \
    WHERE name = ? AND slot = ? AND token = ? AND expires_at > {now}";

const SET_VALUE: &str = "\
    UPDATE tenure_leases SET value = ? \
    WHERE name = ? AND slot = ? AND token = ? AND expires_at > {now}";

/// A lease as stored: the model of a `tenure_leases` row ([`crate::schema::tenure_leases`]),
/// one per holder slot of a name, for your own queries; [`inspect`], [`holders`] and [`list`]
/// read these (with the database's now, to say whether each is held).
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable, QueryableByName)]
#[diesel(table_name = crate::schema::tenure_leases)]
pub struct LeaseRecord {
    /// The lease's name.
    pub name: String,
    /// Which of the name's holders this row is (0 .. N-1).
    pub slot: i32,
    /// The current grant's token; `None` once released. Whoever has it can renew and release
    /// the lease: show it to no one.
    pub token: Option<Uuid>,
    /// The label of the last holder.
    pub holder: String,
    /// The fence of the last grant of this slot.
    pub fence: i64,
    /// When the last grant was made (database clock).
    pub acquired_at: DateTime<Utc>,
    /// When it expires or expired; for a released lease, when it was released.
    pub expires_at: DateTime<Utc>,
    /// When the slot may be granted again (see [`crate::schema::tenure_leases::reusable_at`]).
    pub reusable_at: DateTime<Utc>,
    /// The lock delay its holder asked for, in microseconds.
    pub lock_delay_us: i64,
    /// What the holder published ([`Lease::set_value`]).
    pub value: Option<String>,
    /// The key of the holder's liveness lock (fast takeover, see [`Take::fast_takeover`]);
    /// `None` when it has none.
    pub held_by: Option<i64>,
}

/// A lease this caller was granted. It stays a record of the grant after it is lost or
/// released; [`Lease::renew`] and [`Lease::verify`] say whether it is still held.
#[derive(Debug, Clone)]
pub struct Lease {
    name: String,
    slot: i32,
    token: Uuid,
    fence: i64,
    holder: String,
    acquired_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    lock_delay_micros: i64,
    lost: bool,
}

/// What [`inspect`], [`holders`] and [`list`] show of a lease's holder slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The lease's name.
    pub name: String,
    /// Which of the name's holders (0 .. N-1; always 0 for a lease of one holder).
    pub slot: i32,
    /// The label of the last holder.
    pub holder: String,
    /// The fence of the last grant of this slot.
    pub fence: i64,
    /// When the last grant was made (database clock).
    pub acquired_at: DateTime<Utc>,
    /// When it expires or expired; for a released lease, when it was released.
    pub expires_at: DateTime<Utc>,
    /// Whether someone holds it now: it has a token and `now < expires_at`.
    pub held: bool,
    /// What the holder published with its grant ([`Lease::set_value`]).
    pub value: Option<String>,
    /// When the slot may be granted again: after `expires_at` by the holder's lock delay
    /// while held or lapsed.
    pub reusable_at: DateTime<Utc>,
    /// The database's clock when this was read.
    pub now: DateTime<Utc>,
}

impl LeaseInfo {
    fn new(record: LeaseRecord, now: DateTime<Utc>) -> Self {
        LeaseInfo {
            held: record.token.is_some() && now < record.expires_at,
            name: record.name,
            slot: record.slot,
            holder: record.holder,
            fence: record.fence,
            acquired_at: record.acquired_at,
            expires_at: record.expires_at,
            value: record.value,
            reusable_at: record.reusable_at,
            now,
        }
    }
}

/// A lease's holder slot as (name, slot, token) binds.
macro_rules! bind_holder {
    ($statement:expr, $lease:expr) => {
        $statement
            .bind::<Text, _>($lease.name.as_str())
            .bind::<Integer, _>($lease.slot)
            .bind::<Token, _>($lease.token)
    };
}

impl Lease {
    fn granted(row: LeaseRecord, token: Uuid) -> Lease {
        Lease {
            name: row.name,
            slot: row.slot,
            token,
            fence: row.fence,
            holder: row.holder,
            acquired_at: row.acquired_at,
            expires_at: row.expires_at,
            lock_delay_micros: row.lock_delay_us,
            lost: false,
        }
    }

    /// The lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing number of this grant: strictly greater than every earlier grant's of this
    /// name, whichever holder slot it took.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// Which of the name's holder slots this grant took (0 .. N-1).
    pub fn slot(&self) -> i32 {
        self.slot
    }

    /// The random token that owns this grant.
    pub fn token(&self) -> Uuid {
        self.token
    }

    /// The holder label given when it was taken.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// When it was granted (database clock): the moment the take won the row, after any wait
    /// for the row lock, so never before the previous holder released it or it expired.
    pub fn acquired_at(&self) -> DateTime<Utc> {
        self.acquired_at
    }

    /// The expiry of the last successful take or renewal (database clock).
    pub fn expires_at(&self) -> DateTime<Utc> {
        self.expires_at
    }

    /// True once a renewal or verification found it lost, or after [`Lease::release`]. It
    /// never becomes false again.
    pub fn is_known_lost(&self) -> bool {
        self.lost
    }

    fn lost_error(&self) -> Error {
        Error::LeaseLost {
            name: self.name.clone(),
        }
    }

    /// Extends the lease to the database's now + `ttl`, if this token still holds it and it
    /// has not lapsed; otherwise [`Error::LeaseLost`], and it stays lost. Repeating a renewal
    /// (say, after a lost reply) succeeds. Needs a bare connection.
    pub fn renew<C: TenureConnection>(&mut self, conn: &mut C, ttl: Duration) -> Result<()> {
        let micros = validate::ttl(ttl)?;
        if self.lost {
            return Err(self.lost_error());
        }
        let reusable = micros.saturating_add(self.lock_delay_micros);
        let this = &*self;
        let renewed: Option<DateTime<Utc>> = dispatch!(conn, c => {
            bare_write_transaction(c, "renewing a lease", |c| {
                let syntax = c.syntax();
                let changed = bind_holder!(
                    statement(syntax.render(RENEW))
                        .bind::<BigInt, _>(micros)
                        .bind::<BigInt, _>(reusable),
                    this
                )
                .execute(c)?;
                if changed == 0 {
                    return Ok(None);
                }
                let row = statement(grant::SELECT_SLOT)
                    .bind::<Text, _>(this.name.as_str())
                    .bind::<Integer, _>(this.slot)
                    .get_result::<LeaseRecord>(c)?;
                Ok(Some(row.expires_at))
            })
        })?;
        match renewed {
            Some(expires_at) => {
                self.expires_at = expires_at;
                Ok(())
            }
            None => {
                self.lost = true;
                Err(self.lost_error())
            }
        }
    }

    /// Gives the lease up: clears the token if it is still this one (the row and its fence
    /// stay), and wakes whoever waits for it. Returns whether this call released it; `false`
    /// when it was already released or someone else holds it now, in which case nothing
    /// changes. Safe to repeat. Needs a bare connection.
    pub fn release<C: TenureConnection>(&mut self, conn: &mut C) -> Result<bool> {
        let this = &*self;
        let released = dispatch!(conn, c => {
            bare_write_transaction(c, "releasing a lease", |c| {
                let sql = c.syntax().render(RELEASE);
                let released = bind_holder!(statement(sql), this).execute(c)?;
                take::notify_released(c, &this.name)?;
                Ok(released)
            })
        })?;
        self.lost = true;
        take::wake_waiters();
        Ok(released == 1)
    }

    /// [`Lease::release`] inside the caller's transaction if `conn` has one open (in a
    /// savepoint), on its own otherwise: [`LeaseGuard::release_on`].
    pub(crate) fn release_joining<C: TenureConnection>(&mut self, conn: &mut C) -> Result<bool> {
        let this = &*self;
        let released = crate::backend::transaction::own_transaction(conn, |conn| {
            dispatch!(conn, c => {
                let sql = c.syntax().render(RELEASE);
                let released = bind_holder!(statement(sql), this).execute(c)?;
                take::notify_released(c, &this.name)?;
                Ok::<_, Error>(released)
            })
        })?;
        self.lost = true;
        take::wake_waiters();
        Ok(released == 1)
    }

    /// Inside the caller's transaction: locks the lease's row and checks that this token
    /// holds it and it has not lapsed, so work committed in the same transaction cannot land
    /// after the lease changed hands. [`Error::LeaseLost`] otherwise: return it from the
    /// transaction to roll the work back.
    ///
    /// On SQLite this takes the database's write lock: if the transaction had already read
    /// and another connection wrote since, it fails with a retryable `SQLITE_BUSY`. Open the
    /// transaction with [`crate::transaction`] (IMMEDIATE) to avoid that.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # use std::time::Duration;
    /// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// # tenure::run_migrations(&mut conn)?;
    /// let lease = tenure::lease::try_take(&mut conn, "sync:42", Duration::from_secs(30), "me")?.unwrap();
    /// tenure::transaction(&mut conn, |conn| {
    ///     lease.verify(conn)?;
    ///     // ... write the results of the work here ...
    ///     Ok::<_, tenure::Error>(())
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn verify<C: TenureConnection>(&self, conn: &mut C) -> Result<()> {
        if self.lost {
            return Err(self.lost_error());
        }
        let matched = dispatch!(conn, c => {
            let sql = c.syntax().render(VERIFY);
            bind_holder!(statement(sql), self).execute(c)
        })?;
        if matched == 1 {
            Ok(())
        } else {
            Err(self.lost_error())
        }
    }

    /// Publishes `value` with this grant (a leader's address, a job's progress): readable by
    /// anyone through [`inspect`], [`holders`] and [`leader`], written only while this token
    /// holds the lease and it has not lapsed ([`Error::LeaseLost`] otherwise, and nothing
    /// changes). `None` clears it; a new grant of the slot starts with none. At most
    /// [`MAX_VALUE_BYTES`] bytes. Joins the caller's transaction if one is open, so the value
    /// can commit with the work it describes.
    ///
    /// ```
    /// # fn main() -> Result<(), tenure::Error> {
    /// # use std::time::Duration;
    /// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
    /// # tenure::run_migrations(&mut conn)?;
    /// let lease = tenure::lease::try_take(&mut conn, "primary", Duration::from_secs(30), "host-a")?.unwrap();
    /// lease.set_value(&mut conn, Some("10.0.0.7:8080"))?;
    /// let info = tenure::lease::inspect(&mut conn, "primary")?.unwrap();
    /// assert_eq!(info.value.as_deref(), Some("10.0.0.7:8080"));
    /// # Ok(()) }
    /// ```
    pub fn set_value<C: TenureConnection>(&self, conn: &mut C, value: Option<&str>) -> Result<()> {
        if let Some(value) = value {
            validate::text("lease value", value, MAX_VALUE_BYTES)?;
        }
        if self.lost {
            return Err(self.lost_error());
        }
        let matched = crate::backend::transaction::own_transaction(conn, |conn| {
            dispatch!(conn, c => {
                let sql = c.syntax().render(SET_VALUE);
                bind_holder!(statement(sql).bind::<diesel::sql_types::Nullable<Text>, _>(value), self)
                    .execute(c)
                    .map_err(Error::from)
            })
        })?;
        if matched == 1 {
            Ok(())
        } else {
            Err(self.lost_error())
        }
    }
}

/// Takes the lease `name` for `ttl` if it is absent, released or expired by the database's
/// clock and nobody waits in line for it ([`Take`]); `Ok(None)` if someone holds it. Atomic
/// on every backend: of any number of concurrent callers exactly one gets `Some`, and none
/// gets an error. `holder` is a label for humans (host, process, purpose). Needs a bare
/// connection.
///
/// `name`: 1 to 255 bytes, no NUL, compared byte for byte. `ttl`: 1 ms to 366 days.
pub fn try_take<C: TenureConnection>(
    conn: &mut C,
    name: &str,
    ttl: Duration,
    holder: &str,
) -> Result<Option<Lease>> {
    Take::new(name, ttl, holder).on(conn)
}

/// Like [`try_take`], but waits in line up to `wait`'s timeout for the lease to be free:
/// waiters are served first come, first served, and woken when a holder releases. `Ok(None)`
/// when the timeout passes first. Transient errors (`SQLITE_BUSY`, lock timeouts) are
/// retried until then; others are returned. See [`Take`] for more holders and a lock delay.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// # use std::time::Duration;
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// use tenure::lease::{self, Wait};
/// let wait = Wait::up_to(Duration::from_secs(5)).poll_interval(Duration::from_millis(50));
/// let lease = lease::take(&mut conn, "report", Duration::from_secs(30), "me", wait)?;
/// assert!(lease.is_some());
/// # Ok(()) }
/// ```
pub fn take<C: TenureConnection>(
    conn: &mut C,
    name: &str,
    ttl: Duration,
    holder: &str,
    wait: Wait,
) -> Result<Option<Lease>> {
    Take::new(name, ttl, holder).wait(wait).on(conn)
}

/// For operators: clears the tokens of whoever holds `name` (every holder of a lease of N;
/// the rows and fences stay). Returns whether there was one. The evicted holders' renewals,
/// releases and verifications then fail as lost; each slot is granted again only after its
/// holder's lock delay ([`Take::lock_delay`]), as the holder may still be writing. Needs a
/// bare connection.
pub fn force_release<C: TenureConnection>(conn: &mut C, name: &str) -> Result<bool> {
    use crate::schema::tenure_leases;
    validate::name("lease name", name)?;
    let released = dispatch!(conn, c => {
        bare_write_transaction(c, "force-releasing a lease", |c| {
            let slots = tenure_leases::table
                .filter(tenure_leases::name.eq(name))
                .filter(tenure_leases::token.is_not_null())
                .select(LeaseRecord::as_select())
                .load::<LeaseRecord>(c)?;
            let sql = c.syntax().render(FORCE_RELEASE);
            let mut released = 0;
            for slot in slots {
                // Matched by the token read: a slot granted again since is not this holder's.
                released += statement(sql)
                    .bind::<BigInt, _>(slot.lock_delay_us)
                    .bind::<Text, _>(name)
                    .bind::<Integer, _>(slot.slot)
                    .bind::<diesel::sql_types::Nullable<Token>, _>(slot.token)
                    .execute(c)?;
            }
            if released > 0 {
                take::notify_released(c, name)?;
            }
            Ok(released)
        })
    })?;
    take::wake_waiters();
    Ok(released > 0)
}

/// The holder slot of `name` granted last (its only one for a lease of one holder), or `None`
/// if it was never taken. [`holders`] shows every slot.
pub fn inspect<C: TenureConnection>(conn: &mut C, name: &str) -> Result<Option<LeaseInfo>> {
    Ok(holders(conn, name)?
        .into_iter()
        .max_by_key(|info| info.fence))
}

/// Every holder slot of `name`, by slot (empty if it was never taken).
pub fn holders<C: TenureConnection>(conn: &mut C, name: &str) -> Result<Vec<LeaseInfo>> {
    use crate::schema::tenure_leases;
    validate::name("lease name", name)?;
    let rows = dispatch!(conn, c => {
        tenure_leases::table
            .filter(tenure_leases::name.eq(name))
            .order(tenure_leases::slot)
            .select((LeaseRecord::as_select(), DatabaseNow))
            .load::<(LeaseRecord, DateTime<Utc>)>(c)
    })?;
    Ok(rows
        .into_iter()
        .map(|(record, now)| LeaseInfo::new(record, now))
        .collect())
}

/// Every lease's holder slots, by name and slot.
pub fn list<C: TenureConnection>(conn: &mut C) -> Result<Vec<LeaseInfo>> {
    use crate::schema::tenure_leases;
    let rows = dispatch!(conn, c => {
        tenure_leases::table
            .order((tenure_leases::name, tenure_leases::slot))
            .select((LeaseRecord::as_select(), DatabaseNow))
            .load::<(LeaseRecord, DateTime<Utc>)>(c)
    })?;
    Ok(rows
        .into_iter()
        .map(|(record, now)| LeaseInfo::new(record, now))
        .collect())
}

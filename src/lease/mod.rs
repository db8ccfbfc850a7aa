//! Leases: named, time-limited, token-owned locks in a table (`tenure_leases`).
//!
//! A lease is held by whoever holds its current token, until its expiry by the database's
//! clock. Taking one is atomic on every backend: of any number of concurrent callers exactly
//! one wins, and none gets an error. Each grant has a fresh random token and a *fence*, a
//! number strictly greater than every fence granted before for that name (rows are never
//! deleted, so fences never go back): pass it along with the work so that whatever the work
//! writes to can refuse a stale holder.
//!
//! | operation | connection | what it does |
//! |---|---|---|
//! | [`try_take`] / [`take`] | bare | grant if absent, released or expired; `take` waits |
//! | [`Lease::renew`] | bare | expiry = database now + ttl, if still held and not lapsed |
//! | [`Lease::release`] | bare | clears the token if still ours; idempotent |
//! | [`Lease::verify`] | caller's transaction | locks the row and checks token and expiry |
//! | [`force_release`] | bare | operators: clears whoever's token |
//! | [`inspect`] / [`list`] | any | holder, fence, times and the database's now |
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

mod guard;

use std::time::{Duration, Instant as Clock};

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use uuid::Uuid;

use crate::backend::statement::statement;
use crate::backend::transaction::bare_write_transaction;
use crate::backend::{Dialect, Upsert, dispatch};
use crate::sql_types::{DatabaseNow, Token};
use crate::{Error, Result, TenureConnection, validate};

pub use guard::{LeaseGuard, RELEASE_WAIT};

/// PostgreSQL and SQLite. The update happens only when the row is released or expired; when
/// it does not, the statement changes nothing. On PostgreSQL a contender that waited for
/// another's row lock re-checks the WHERE on the row the other committed, so it cannot
/// overwrite a fresh grant (the race of a SELECT followed by an unconditional UPDATE).
///
/// The grant's times are those of the moment the statement won the row (`{grant_times}`),
/// not of its start: a take that waited for the row lock (behind the holder's release, or
/// its `verify` transaction) would otherwise record a grant instant from before the previous
/// holder let go, and a lease shorter than its ttl by the wait.
const TAKE_ON_CONFLICT: &str = "\
    INSERT INTO tenure_leases (name, token, holder, fence, acquired_at, expires_at) \
    VALUES (?, ?, ?, 1, {now}, {now+ttl}) \
    ON CONFLICT (name) DO UPDATE SET token = excluded.token, holder = excluded.holder, \
        fence = tenure_leases.fence + 1, {grant_times} \
    WHERE tenure_leases.token IS NULL OR tenure_leases.expires_at <= {now}";

/// MySQL/MariaDB: no WHERE on an upsert, so every column is conditional. MySQL assigns left
/// to right and each assignment sees the ones before it: `token` decides first, from the old
/// row, and the others follow "the token is now ours". The token is 128 random bits, so it
/// equals ours only if this statement wrote it. (`ON DUPLICATE KEY UPDATE` takes an exclusive
/// record lock on the existing primary key, not the shared lock of a failed plain INSERT,
/// which is what makes contenders deadlock.)
///
/// As on PostgreSQL, the grant is stamped when the statement won the row: `UTC_TIMESTAMP(6)`
/// is the statement's start, before any wait for the row lock, so the time waited (`SYSDATE`
/// runs on, `NOW` does not; both in the session's zone) is added. The expiry is the new
/// `acquired_at` plus the ttl (the ttl being the difference of the two inserted values).
const TAKE_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_leases (name, token, holder, fence, acquired_at, expires_at) \
    VALUES (?, ?, ?, 1, {now}, {now+ttl}) \
    ON DUPLICATE KEY UPDATE \
        token = IF(token IS NULL OR expires_at <= {now}, VALUES(token), token), \
        fence = IF(token = VALUES(token), fence + 1, fence), \
        holder = IF(token = VALUES(token), VALUES(holder), holder), \
        acquired_at = IF(token = VALUES(token), UTC_TIMESTAMP(6) + INTERVAL \
            GREATEST(0, TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6))) MICROSECOND, acquired_at), \
        expires_at = IF(token = VALUES(token), acquired_at + INTERVAL \
            TIMESTAMPDIFF(MICROSECOND, VALUES(acquired_at), VALUES(expires_at)) MICROSECOND, \
            expires_at)";

/// A lease row, read back after a take or a renewal.
const SELECT_LEASE: &str = "\
    SELECT name, token, holder, fence, acquired_at, expires_at FROM tenure_leases WHERE name = ?";

/// Only the current token, and only while not lapsed: a renewal after the lease lapsed says
/// "lost" even if nobody took it over.
const RENEW: &str = "\
    UPDATE tenure_leases SET expires_at = {now+ttl} \
    WHERE name = ? AND token = ? AND expires_at > {now}";

/// Clears the token; the row and its fence stay. A released lease's expiry becomes the
/// release time (if that is earlier).
const RELEASE: &str = "\
    UPDATE tenure_leases SET token = NULL, \
        expires_at = CASE WHEN expires_at > {now} THEN {now} ELSE expires_at END \
    WHERE name = ? AND token = ?";

const FORCE_RELEASE: &str = "\
    UPDATE tenure_leases SET token = NULL, \
        expires_at = CASE WHEN expires_at > {now} THEN {now} ELSE expires_at END \
    WHERE name = ? AND token IS NOT NULL";

/// A write that changes nothing but takes the row's write lock in the caller's transaction
/// (on SQLite, the database's write lock), so the lease cannot change hands before it
/// commits. It matches only while the token is ours and the lease has not lapsed.
const VERIFY: &str = "\
    UPDATE tenure_leases SET fence = fence \
    WHERE name = ? AND token = ? AND expires_at > {now}";

/// A lease as stored: the model of a `tenure_leases` row ([`crate::schema::tenure_leases`]), for
/// your own queries; [`inspect`] and [`list`] read these (with the database's now, to say
/// whether each is held).
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable, QueryableByName)]
#[diesel(table_name = crate::schema::tenure_leases)]
pub struct LeaseRecord {
    /// The lease's name.
    pub name: String,
    /// The current grant's token; `None` once released. Whoever has it can renew and release
    /// the lease: show it to no one.
    pub token: Option<Uuid>,
    /// The label of the last holder.
    pub holder: String,
    /// The fence of the last grant.
    pub fence: i64,
    /// When the last grant was made (database clock).
    pub acquired_at: DateTime<Utc>,
    /// When it expires or expired; for a released lease, when it was released.
    pub expires_at: DateTime<Utc>,
}

/// A lease this caller was granted. It stays a record of the grant after it is lost or
/// released; [`Lease::renew`] and [`Lease::verify`] say whether it is still held.
#[derive(Debug, Clone)]
pub struct Lease {
    name: String,
    token: Uuid,
    fence: i64,
    holder: String,
    acquired_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    lost: bool,
}

/// What [`inspect`] and [`list`] show of a lease row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The lease's name.
    pub name: String,
    /// The label of the last holder.
    pub holder: String,
    /// The fence of the last grant.
    pub fence: i64,
    /// When the last grant was made (database clock).
    pub acquired_at: DateTime<Utc>,
    /// When it expires or expired; for a released lease, when it was released.
    pub expires_at: DateTime<Utc>,
    /// Whether someone holds it now: it has a token and `now < expires_at`.
    pub held: bool,
    /// The database's clock when this was read.
    pub now: DateTime<Utc>,
}

impl LeaseInfo {
    fn new(record: LeaseRecord, now: DateTime<Utc>) -> Self {
        LeaseInfo {
            held: record.token.is_some() && now < record.expires_at,
            name: record.name,
            holder: record.holder,
            fence: record.fence,
            acquired_at: record.acquired_at,
            expires_at: record.expires_at,
            now,
        }
    }
}

impl Lease {
    /// The lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing number of this grant: strictly greater than every earlier grant's.
    pub fn fence(&self) -> i64 {
        self.fence
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
        let (name, token) = (self.name.as_str(), self.token);
        let renewed: Option<DateTime<Utc>> = dispatch!(conn, c => {
            bare_write_transaction(c, "renewing a lease", |c| {
                let syntax = c.syntax();
                let changed = statement(syntax.render(RENEW))
                    .bind::<BigInt, _>(micros)
                    .bind::<Text, _>(name)
                    .bind::<Token, _>(token)
                    .execute(c)?;
                if changed == 0 {
                    return Ok(None);
                }
                let row = statement(SELECT_LEASE)
                    .bind::<Text, _>(name)
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
    /// stay). Returns whether this call released it; `false` when it was already released or
    /// someone else holds it now, in which case nothing changes. Safe to repeat. Needs a bare
    /// connection.
    pub fn release<C: TenureConnection>(&mut self, conn: &mut C) -> Result<bool> {
        let (name, token) = (self.name.as_str(), self.token);
        let released = dispatch!(conn, c => {
            bare_write_transaction(c, "releasing a lease", |c| {
                let sql = c.syntax().render(RELEASE);
                Ok(statement(sql)
                    .bind::<Text, _>(name)
                    .bind::<Token, _>(token)
                    .execute(c)?)
            })
        })?;
        self.lost = true;
        Ok(released == 1)
    }

    /// [`Lease::release`] inside the caller's transaction if `conn` has one open (in a
    /// savepoint), on its own otherwise: [`LeaseGuard::release_on`].
    pub(crate) fn release_joining<C: TenureConnection>(&mut self, conn: &mut C) -> Result<bool> {
        let (name, token) = (self.name.as_str(), self.token);
        let released = crate::transaction(conn, |conn| {
            dispatch!(conn, c => {
                let sql = c.syntax().render(RELEASE);
                statement(sql)
                    .bind::<Text, _>(name)
                    .bind::<Token, _>(token)
                    .execute(c)
            })
        })?;
        self.lost = true;
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
        let (name, token) = (self.name.as_str(), self.token);
        let matched = dispatch!(conn, c => {
            let sql = c.syntax().render(VERIFY);
            statement(sql)
                .bind::<Text, _>(name)
                .bind::<Token, _>(token)
                .execute(c)
        })?;
        if matched == 1 {
            Ok(())
        } else {
            Err(self.lost_error())
        }
    }
}

/// Takes the lease `name` for `ttl` if it is absent, released or expired by the database's
/// clock; `Ok(None)` if someone holds it. Atomic on every backend: of any number of
/// concurrent callers exactly one gets `Some`, and none gets an error. `holder` is a label
/// for humans (host, process, purpose). Needs a bare connection.
///
/// `name`: 1 to 255 bytes, no NUL, compared byte for byte. `ttl`: 1 ms to 366 days.
pub fn try_take<C: TenureConnection>(
    conn: &mut C,
    name: &str,
    ttl: Duration,
    holder: &str,
) -> Result<Option<Lease>> {
    validate::name("lease name", name)?;
    validate::label("holder", holder)?;
    let micros = validate::ttl(ttl)?;
    let token = Uuid::new_v4();
    let row = dispatch!(conn, c => {
        bare_write_transaction(c, "taking a lease", |c| {
            let syntax = c.syntax();
            let upsert = match syntax.upsert {
                Upsert::OnConflictWhere => TAKE_ON_CONFLICT,
                Upsert::OnDuplicateKey => TAKE_ON_DUPLICATE_KEY,
            };
            statement(syntax.render(upsert))
                .bind::<Text, _>(name)
                .bind::<Token, _>(token)
                .bind::<Text, _>(holder)
                .bind::<BigInt, _>(micros)
                .execute(c)?;
            // The winner is decided by reading the row back, not by an affected-rows count
            // (MySQL reports 1 for an upsert that changed nothing).
            let row = statement(SELECT_LEASE)
                .bind::<Text, _>(name)
                .get_result::<LeaseRecord>(c)?;
            Ok(row)
        })
    })?;
    if row.token != Some(token) {
        return Ok(None);
    }
    Ok(Some(Lease {
        name: row.name,
        token,
        fence: row.fence,
        holder: row.holder,
        acquired_at: row.acquired_at,
        expires_at: row.expires_at,
        lost: false,
    }))
}

/// How long [`take`] waits, and how often it asks.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    timeout: Duration,
    poll_interval: Duration,
}

impl Wait {
    /// Wait up to `timeout`, asking at most every 100 ms once the backoff has grown.
    pub fn up_to(timeout: Duration) -> Wait {
        Wait {
            timeout,
            poll_interval: Duration::from_millis(100),
        }
    }

    /// The longest pause between two attempts (default 100 ms): after the holder releases,
    /// [`take`] returns within about this long.
    pub fn poll_interval(mut self, poll_interval: Duration) -> Wait {
        self.poll_interval = poll_interval;
        self
    }
}

/// Like [`try_take`], but waits up to `wait`'s timeout for the lease to be free, polling with
/// jittered exponential backoff (10 ms growing to the poll interval). `Ok(None)` when the
/// timeout passes first. Transient errors (`SQLITE_BUSY`, lock timeouts) are retried until
/// then; others are returned.
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
    Ok(take_timed(conn, name, ttl, holder, wait)?.map(|(lease, _)| lease))
}

/// [`take`], also returning when the winning attempt was sent (for the guard's deadline).
fn take_timed<C: TenureConnection>(
    conn: &mut C,
    name: &str,
    ttl: Duration,
    holder: &str,
    wait: Wait,
) -> Result<Option<(Lease, Clock)>> {
    if wait.poll_interval.is_zero() {
        return Err(Error::invalid("poll interval", "must be longer than zero"));
    }
    let deadline = Clock::now() + wait.timeout;
    let mut backoff = wait.poll_interval.min(Duration::from_millis(10));
    loop {
        let sent = Clock::now();
        match try_take(conn, name, ttl, holder) {
            Ok(Some(lease)) => return Ok(Some((lease, sent))),
            Ok(None) => {}
            Err(e) if e.is_retryable() => {}
            Err(e) => return Err(e),
        }
        let now = Clock::now();
        if now >= deadline {
            return Ok(None);
        }
        // Uniform in [backoff/2, backoff], so contenders do not poll in step.
        let pause = backoff.mul_f64(rand::random_range(0.5..=1.0));
        std::thread::sleep(pause.min(deadline - now));
        backoff = (backoff * 2).min(wait.poll_interval);
    }
}

/// For operators: clears whatever token holds `name` (the row and its fence stay). Returns
/// whether there was one. The evicted holder's renewals, releases and verifications then
/// fail as lost. Needs a bare connection.
pub fn force_release<C: TenureConnection>(conn: &mut C, name: &str) -> Result<bool> {
    validate::name("lease name", name)?;
    let released = dispatch!(conn, c => {
        bare_write_transaction(c, "force-releasing a lease", |c| {
            let sql = c.syntax().render(FORCE_RELEASE);
            Ok(statement(sql).bind::<Text, _>(name).execute(c)?)
        })
    })?;
    Ok(released == 1)
}

/// The lease row for `name`, or `None` if it was never taken.
pub fn inspect<C: TenureConnection>(conn: &mut C, name: &str) -> Result<Option<LeaseInfo>> {
    use crate::schema::tenure_leases;
    validate::name("lease name", name)?;
    let row = dispatch!(conn, c => {
        tenure_leases::table
            .find(name)
            .select((LeaseRecord::as_select(), DatabaseNow))
            .get_result::<(LeaseRecord, DateTime<Utc>)>(c)
            .optional()
    })?;
    Ok(row.map(|(record, now)| LeaseInfo::new(record, now)))
}

/// Every lease row, by name.
pub fn list<C: TenureConnection>(conn: &mut C) -> Result<Vec<LeaseInfo>> {
    use crate::schema::tenure_leases;
    let rows = dispatch!(conn, c => {
        tenure_leases::table
            .order(tenure_leases::name)
            .select((LeaseRecord::as_select(), DatabaseNow))
            .load::<(LeaseRecord, DateTime<Utc>)>(c)
    })?;
    Ok(rows
        .into_iter()
        .map(|(record, now)| LeaseInfo::new(record, now))
        .collect())
}

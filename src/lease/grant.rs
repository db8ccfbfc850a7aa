//! One attempt to grant a lease: the transaction that decides, under the lock of the name's
//! row, whether a slot is free for this caller and whether anyone waits before it in line.
//!
//! Every grant of a name locks its `tenure_lease_names` row first, then its slot rows, so
//! grants of one name take turns (and a grant waits for a holder's open [`verify`]
//! transaction, which locks its slot's row). The decision is made in Rust from rows read
//! under those locks with the database's clock; nothing it read can change before the
//! commit. Renewals, releases and verifications lock only their own slot row.
//!
//! [`verify`]: super::Lease::verify

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use uuid::Uuid;

use std::time::Duration;

use super::liveness::TAKEOVER_AFTER;
use super::{Lease, LeaseRecord};
use crate::backend::statement::statement;
use crate::backend::transaction::bare_write_transaction;
use crate::backend::{Dialect, FileLock, Liveness, LockSpace, Probe, Upsert, dispatch};
use crate::sql_types::{Instant, Token};
use crate::{Error, Result, TenureConnection};

/// Creates the name's row if it is new; on MySQL also takes its lock (an
/// `ON DUPLICATE KEY UPDATE` takes the exclusive lock; a failed plain insert would take a
/// shared one, and two of those deadlock on the `FOR UPDATE` that follows).
const NAME_ON_CONFLICT: &str = "\
    INSERT INTO tenure_lease_names (name, holders, fence, next_ticket) VALUES (?, ?, 0, 1) \
    ON CONFLICT (name) DO NOTHING";
const NAME_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_lease_names (name, holders, fence, next_ticket) VALUES (?, ?, 0, 1) \
    ON DUPLICATE KEY UPDATE fence = fence";

const LOCK_NAME: &str = "\
    SELECT holders, fence, next_ticket FROM tenure_lease_names WHERE name = ?{for_update}";

/// The name's slots, locked, with the clock read after the locks were granted (on
/// PostgreSQL `statement_timestamp()` is the statement's start, before any wait: an earlier
/// clock only finds fewer slots free).
const LOCK_SLOTS: &str = "\
    SELECT slot, expires_at, reusable_at, held_by, {now} AS now FROM tenure_leases \
    WHERE name = ? ORDER BY slot{for_update}";

/// A held slot whose holder's liveness lock was found free: it lapses at `{now+ttl}` (the
/// bind is [`TAKEOVER_AFTER`], or 0 where a free lock means a dead process) unless sooner,
/// and may be granted again then (no lock delay). The holder's next renewal undoes it. Each
/// column's CASE reads only itself: MySQL's order of assignment does not matter.
const HOLDER_GONE: &str = "\
    UPDATE tenure_leases SET \
        expires_at = CASE WHEN expires_at > {now+ttl} THEN {now+ttl} ELSE expires_at END, \
        reusable_at = CASE WHEN reusable_at > {now+ttl} THEN {now+ttl} ELSE reusable_at END \
    WHERE name = ? AND slot = ?";

/// The live places in line: how many stand before the caller's ticket, how many there are,
/// and whether the caller's own place is among them.
const LINE: &str = "\
    SELECT COUNT(CASE WHEN ticket < ? THEN 1 END) AS ahead, COUNT(*) AS live, \
        COUNT(CASE WHEN ticket = ? THEN 1 END) AS mine \
    FROM tenure_lease_waiters WHERE name = ? AND expires_at > {now}";

/// A grant to an existing slot, decided free under its lock. The two `{now+ttl}` are the
/// expiry and the time the slot may be granted again once lapsed (expiry + lock delay).
///
/// Only inside its transaction (`{in_transaction}`, MySQL; checked by its count): a Galera node
/// may roll the grant back between two statements without telling the next one, and this
/// update run on its own would overwrite the grant another node's transaction just committed
/// (a double holder). A new slot's insert needs no guard: the other node's row is there, and
/// the insert fails on its key.
const GRANT_SLOT: &str = "\
    UPDATE tenure_leases SET token = ?, holder = ?, fence = ?, acquired_at = {now}, \
        expires_at = {now+ttl}, reusable_at = {now+ttl}, lock_delay_us = ?, value = NULL, \
        held_by = ? \
    WHERE name = ? AND slot = ?{in_transaction}";

const GRANT_NEW_SLOT: &str = "\
    INSERT INTO tenure_leases (name, slot, token, holder, fence, acquired_at, expires_at, \
        reusable_at, lock_delay_us, held_by) \
    VALUES (?, ?, ?, ?, ?, {now}, {now+ttl}, {now+ttl}, ?, ?)";

const GRANTED: &str = "UPDATE tenure_lease_names SET fence = ?, holders = ? WHERE name = ?";

pub(super) const SELECT_SLOT: &str = "\
    SELECT name, slot, token, holder, fence, acquired_at, expires_at, reusable_at, \
        lock_delay_us, value, held_by \
    FROM tenure_leases WHERE name = ? AND slot = ?";

const JOIN_LINE: &str = "\
    INSERT INTO tenure_lease_waiters (name, ticket, holder, joined_at, expires_at) \
    VALUES (?, ?, ?, {now}, {now+ttl})";

const NEXT_TICKET: &str =
    "UPDATE tenure_lease_names SET next_ticket = next_ticket + 1 WHERE name = ?";

/// Only while the place has not lapsed: a waiter whose place lapsed joins again at the end.
const KEEP_PLACE: &str = "\
    UPDATE tenure_lease_waiters SET expires_at = {now+ttl} \
    WHERE name = ? AND ticket = ? AND expires_at > {now}";

pub(super) const LEAVE_LINE: &str =
    "DELETE FROM tenure_lease_waiters WHERE name = ? AND ticket = ?";

const DROP_LAPSED_PLACES: &str =
    "DELETE FROM tenure_lease_waiters WHERE name = ? AND expires_at <= {now}";

#[derive(QueryableByName)]
struct NameRow {
    #[diesel(sql_type = Integer)]
    holders: i32,
    #[diesel(sql_type = BigInt)]
    fence: i64,
    #[diesel(sql_type = BigInt)]
    next_ticket: i64,
}

#[derive(QueryableByName)]
struct SlotRow {
    #[diesel(sql_type = Integer)]
    slot: i32,
    #[diesel(sql_type = Instant)]
    expires_at: DateTime<Utc>,
    #[diesel(sql_type = Instant)]
    reusable_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<BigInt>)]
    held_by: Option<i64>,
    #[diesel(sql_type = Instant)]
    now: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct LineRow {
    #[diesel(sql_type = BigInt)]
    ahead: i64,
    #[diesel(sql_type = BigInt)]
    live: i64,
    #[diesel(sql_type = BigInt)]
    mine: i64,
}

/// What one attempt asks for (checked by the caller).
pub(super) struct Ask<'a> {
    pub name: &'a str,
    pub holder: &'a str,
    pub holders: u32,
    pub ttl_micros: i64,
    pub lock_delay_micros: i64,
    /// Where the caller stands in line.
    pub line: Line,
    /// How long a place in line lasts unless renewed, in microseconds.
    pub place_micros: i64,
    /// The key of the holder's liveness lock ([`super::liveness`]), if it has one.
    pub held_by: Option<i64>,
}

/// Where a caller stands in line for a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Line {
    /// Not in line, and not joining (`try_take`): granted only if nobody waits.
    Outside,
    /// Not in line yet; joins at the end if not granted now.
    Join,
    /// In line with this ticket; renews its place if not granted now.
    At(i64),
}

/// What an attempt came to.
pub(super) enum Attempt {
    Granted(Lease),
    /// Not granted; the caller's place in line now, if it stands in one.
    Busy(Line),
}

pub(super) fn attempt<C: TenureConnection>(conn: &mut C, ask: &Ask<'_>) -> Result<Attempt> {
    let token = Uuid::new_v4();
    // The lock files of dead holders this attempt found (SQLite), locked by it: removed once
    // its shortening of their grants committed, else only unlocked (a later look finds them
    // free again).
    let mut gone = Vec::new();
    let outcome = dispatch!(conn, c => {
        bare_write_transaction(c, "taking a lease", |c| attempt_in(c, ask, token, &mut gone))
    });
    if outcome.is_ok() {
        gone.into_iter().for_each(FileLock::remove);
    }
    outcome
}

fn attempt_in<D: Dialect + TenureConnection>(
    c: &mut D,
    ask: &Ask<'_>,
    token: Uuid,
    gone: &mut Vec<FileLock>,
) -> Result<Attempt> {
    let syntax = c.syntax();
    let holders = i32::try_from(ask.holders).unwrap_or(i32::MAX);
    let create = match syntax.upsert {
        Upsert::OnConflictWhere => NAME_ON_CONFLICT,
        Upsert::OnDuplicateKey => NAME_ON_DUPLICATE_KEY,
    };
    dispatch!(c, c => statement(create)
        .bind::<Text, _>(ask.name)
        .bind::<Integer, _>(holders)
        .execute(c))?;
    // Written (or locked) by the statement before: gone only if the transaction was rolled
    // back under it (a Galera brute-force abort; see `Error::RolledBackUnderUs`).
    let name_row = dispatch!(c, c => statement(syntax.render(LOCK_NAME))
        .bind::<Text, _>(ask.name)
        .get_result::<NameRow>(c)
        .optional())?
    .ok_or(Error::RolledBackUnderUs {
        operation: "taking a lease",
    })?;
    let mut slots = dispatch!(c, c => statement(syntax.render(LOCK_SLOTS))
        .bind::<Text, _>(ask.name)
        .load::<SlotRow>(c))?;
    for slot in &mut slots {
        take_over_if_gone(c, ask.name, slot, gone)?;
    }

    let ticket = match ask.line {
        Line::At(ticket) => ticket,
        Line::Outside | Line::Join => i64::MAX,
    };
    let line = dispatch!(c, c => statement(syntax.render(LINE))
        .bind::<BigInt, _>(ticket)
        .bind::<BigInt, _>(ticket)
        .bind::<Text, _>(ask.name)
        .get_result::<LineRow>(c))?;
    // A caller whose place lapsed stands behind every live waiter, as one joining now.
    let ahead = if line.mine > 0 { line.ahead } else { line.live };

    // A slot is taken while held or while its lock delay runs after a lapse. The name keeps
    // its number of holders while a slot is taken or anyone waits (for that number).
    let taken = |s: &SlotRow| s.reusable_at > s.now;
    if name_row.holders != holders && (slots.iter().any(taken) || line.live > 0) {
        return Err(Error::LeaseHoldersMismatch {
            name: ask.name.to_owned(),
            holders: u32::try_from(name_row.holders).unwrap_or(0),
            asked: ask.holders,
        });
    }
    let in_range = |s: &&SlotRow| s.slot >= 0 && s.slot < holders;
    let taken_count = slots.iter().filter(in_range).filter(|s| taken(s)).count();
    let free_count = usize::try_from(holders)
        .unwrap_or(0)
        .saturating_sub(taken_count);
    // The lowest free slot: a free row, or the first number no row has.
    let free = (0..holders).find(|n| !slots.iter().any(|s| s.slot == *n && taken(s)));
    let served = i64::try_from(free_count).unwrap_or(i64::MAX) > ahead;
    match free {
        Some(slot) if served => {
            let exists = slots.iter().any(|s| s.slot == slot);
            grant(c, ask, token, slot, exists, name_row.fence + 1)
        }
        _ => Ok(Attempt::Busy(stand_in_line(c, ask, name_row.next_ticket)?)),
    }
}

/// A held slot whose holder's liveness lock is free (see [`super::liveness`]): its grant now
/// lapses soon (at once where the lock says the process ended) unless the holder renews it,
/// and `slot` is updated as it now stands.
fn take_over_if_gone<D: Dialect + TenureConnection>(
    c: &mut D,
    name: &str,
    slot: &mut SlotRow,
    gone: &mut Vec<FileLock>,
) -> Result<()> {
    let Some(key) = slot.held_by.filter(|key| *key > 0) else {
        return Ok(());
    };
    if slot.expires_at <= slot.now {
        return Ok(());
    }
    let after = match dispatch!(c, c => c.probe_liveness_lock(LockSpace::LeaseHolder, key))? {
        Probe::Held | Probe::Unknown => return Ok(()),
        // A lock file is free only once its process ended: nothing of it can still act.
        Probe::Free(Some(file)) => {
            gone.push(file);
            Duration::ZERO
        }
        // A session ended; its process may live, and knows it lost by then.
        Probe::Free(None) => TAKEOVER_AFTER,
    };
    let lapses = slot.now + chrono::Duration::from_std(after).unwrap_or_default();
    if slot.expires_at <= lapses && slot.reusable_at <= lapses {
        // Shortened by an earlier look already.
        return Ok(());
    }
    let micros = i64::try_from(after.as_micros()).unwrap_or(i64::MAX);
    dispatch!(c, c => statement(c.syntax().render(HOLDER_GONE))
        .bind::<BigInt, _>(micros)
        .bind::<BigInt, _>(micros)
        .bind::<BigInt, _>(micros)
        .bind::<BigInt, _>(micros)
        .bind::<Text, _>(name)
        .bind::<Integer, _>(slot.slot)
        .execute(c))?;
    slot.expires_at = slot.expires_at.min(lapses);
    slot.reusable_at = slot.reusable_at.min(lapses);
    tracing::info!(target: "tenure::lease", lease = name, slot = slot.slot, "the holder's liveness lock is free: its grant lapses early unless it renews");
    Ok(())
}

fn grant<D: Dialect + TenureConnection>(
    c: &mut D,
    ask: &Ask<'_>,
    token: Uuid,
    slot: i32,
    exists: bool,
    fence: i64,
) -> Result<Attempt> {
    let syntax = c.syntax();
    let reusable_micros = ask.ttl_micros.saturating_add(ask.lock_delay_micros);
    if exists {
        let changed = dispatch!(c, c => statement(syntax.render(GRANT_SLOT))
            .bind::<Token, _>(token)
            .bind::<Text, _>(ask.holder)
            .bind::<BigInt, _>(fence)
            .bind::<BigInt, _>(ask.ttl_micros)
            .bind::<BigInt, _>(reusable_micros)
            .bind::<BigInt, _>(ask.lock_delay_micros)
            .bind::<Nullable<BigInt>, _>(ask.held_by)
            .bind::<Text, _>(ask.name)
            .bind::<Integer, _>(slot)
            .execute(c))?;
        if changed != 1 {
            return Err(Error::RolledBackUnderUs {
                operation: "taking a lease",
            });
        }
    } else {
        dispatch!(c, c => statement(syntax.render(GRANT_NEW_SLOT))
            .bind::<Text, _>(ask.name)
            .bind::<Integer, _>(slot)
            .bind::<Token, _>(token)
            .bind::<Text, _>(ask.holder)
            .bind::<BigInt, _>(fence)
            .bind::<BigInt, _>(ask.ttl_micros)
            .bind::<BigInt, _>(reusable_micros)
            .bind::<BigInt, _>(ask.lock_delay_micros)
            .bind::<Nullable<BigInt>, _>(ask.held_by)
            .execute(c))?;
    }
    dispatch!(c, c => statement(GRANTED)
        .bind::<BigInt, _>(fence)
        .bind::<Integer, _>(i32::try_from(ask.holders).unwrap_or(i32::MAX))
        .bind::<Text, _>(ask.name)
        .execute(c))?;
    if let Line::At(ticket) = ask.line {
        dispatch!(c, c => statement(LEAVE_LINE)
            .bind::<Text, _>(ask.name)
            .bind::<BigInt, _>(ticket)
            .execute(c))?;
    }
    dispatch!(c, c => statement(syntax.render(DROP_LAPSED_PLACES))
        .bind::<Text, _>(ask.name)
        .execute(c))?;
    // Written by this transaction: gone only if it was rolled back under it, as above.
    let row = dispatch!(c, c => statement(SELECT_SLOT)
        .bind::<Text, _>(ask.name)
        .bind::<Integer, _>(slot)
        .get_result::<LeaseRecord>(c)
        .optional())?
    .filter(|row| row.token == Some(token))
    .ok_or(Error::RolledBackUnderUs {
        operation: "taking a lease",
    })?;
    Ok(Attempt::Granted(Lease::granted(row, token)))
}

/// Not granted: a caller that waits keeps its place, or joins the line at its end.
fn stand_in_line<D: Dialect + TenureConnection>(
    c: &mut D,
    ask: &Ask<'_>,
    next_ticket: i64,
) -> Result<Line> {
    let syntax = c.syntax();
    if let Line::At(ticket) = ask.line {
        let kept = dispatch!(c, c => statement(syntax.render(KEEP_PLACE))
            .bind::<BigInt, _>(ask.place_micros)
            .bind::<Text, _>(ask.name)
            .bind::<BigInt, _>(ticket)
            .execute(c))?;
        if kept == 1 {
            return Ok(Line::At(ticket));
        }
        // Its place lapsed (it waited too long between two attempts): the end of the line.
        dispatch!(c, c => statement(LEAVE_LINE)
            .bind::<Text, _>(ask.name)
            .bind::<BigInt, _>(ticket)
            .execute(c))?;
    } else if ask.line == Line::Outside {
        return Ok(Line::Outside);
    }
    dispatch!(c, c => statement(syntax.render(JOIN_LINE))
        .bind::<Text, _>(ask.name)
        .bind::<BigInt, _>(next_ticket)
        .bind::<Text, _>(ask.holder)
        .bind::<BigInt, _>(ask.place_micros)
        .execute(c))?;
    dispatch!(c, c => statement(NEXT_TICKET)
        .bind::<Text, _>(ask.name)
        .execute(c))?;
    Ok(Line::At(next_ticket))
}

/// Leaves the line (a waiter that gave up), in a transaction of its own.
pub(super) fn leave_line<C: TenureConnection>(conn: &mut C, name: &str, ticket: i64) -> Result<()> {
    dispatch!(conn, c => {
        bare_write_transaction(c, "leaving a lease's line", |c| {
            statement(LEAVE_LINE)
                .bind::<Text, _>(name)
                .bind::<BigInt, _>(ticket)
                .execute(c)?;
            Ok(())
        })
    })
}

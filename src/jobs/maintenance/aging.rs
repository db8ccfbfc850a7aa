//! Priority aging: a job due for longer than a queue's bound moves to the front of its queue,
//! so a steady stream of more urgent jobs delays it by at most that bound.
//!
//! Claims order by priority, then due time, then id. A job aged here gets [`AGED_PRIORITY`],
//! the most urgent there is, so only jobs of that priority that were due before it (other aged
//! jobs, in the order they came due) are claimed ahead of it. The claim path is unchanged: its
//! index serves the aged jobs as any others (on PostgreSQL and MySQL/MariaDB the ready ring's
//! triggers follow the new priority).

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};

use crate::backend::statement::statement;
use crate::backend::transaction::{in_transaction, retry_transient};
use crate::backend::{Dialect, dispatch};
use crate::jobs::queue::{check_count, ids_of};
use crate::rows::IdRow;
use crate::{Error, Result, TenureConnection, validate};

/// The priority an aged job gets: the most urgent (claims take lower priorities first).
pub const AGED_PRIORITY: i32 = i32::MIN;

/// The waiting jobs of a queue due for longer than the bound and not aged yet, read where
/// claims read (the ready ring on PostgreSQL and MySQL/MariaDB, the claim index on SQLite),
/// those due first first: a limited call must never age the urgent jobs of a backlog and
/// leave older, less urgent ones (the claim index would hand out the most urgent first). A
/// plain read: the change below checks again.
const AGED_CANDIDATES: &str = "\
    SELECT c.id AS id FROM {claim_from} WHERE c.queue = ?{claim_waiting} \
    AND c.priority > ? AND c.due_at <= {now+ttl} ORDER BY c.due_at, c.id LIMIT ?";

/// Ages the candidates that still wait, still due for longer than the bound, by primary key:
/// a job claimed, cancelled or rescheduled since the read is left as it is.
const AGE: &str = "\
    UPDATE tenure_jobs SET priority = ? \
    WHERE state = 'waiting' AND priority > ? AND due_at <= {now+ttl} AND id IN {ids}";

/// Moves up to `limit` (1 to [`crate::jobs::MAX_BATCH`]) waiting jobs of `queue` that have
/// been due for longer than `after` (by the database's clock) to [`AGED_PRIORITY`]; returns
/// how many it moved. Jobs already at that priority are left alone, so a call finds only
/// jobs that have come of age since the last one.
///
/// **The bound it gives**: with this called every `period`, a waiting job is claimed ahead of
/// by more urgent jobs for at most `after + period` past its due time; after that, only jobs
/// due before it are claimed first (in a queue of a steady stream of urgent work, the aged
/// jobs take turns in the order they came due). A worker does it for its queues when built
/// with [`crate::worker::WorkerBuilder::age_priorities`].
///
/// An aged job keeps [`AGED_PRIORITY`] when it is retried or snoozed. `after` must be
/// between 1 ms and 366 days; anything else is [`Error::InvalidInput`] and changes nothing.
/// Needs a connection outside any transaction ([`Error::InTransaction`] otherwise): under a
/// caller's older snapshot the ready ring, rotated since, would read as empty (PostgreSQL) or
/// the read would never return (MariaDB).
///
/// [`Error::InTransaction`]: crate::Error::InTransaction
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let job = jobs::enqueue(&mut conn, &NewJob::new("mail", "digest", vec![]).priority(10))?;
/// std::thread::sleep(Duration::from_millis(20));
/// assert_eq!(jobs::age_priorities(&mut conn, "mail", Duration::from_millis(10), 100)?, 1);
/// assert_eq!(jobs::get(&mut conn, job.id)?.unwrap().priority, jobs::AGED_PRIORITY);
/// # Ok(()) }
/// ```
pub fn age_priorities<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    after: Duration,
    limit: usize,
) -> Result<usize> {
    validate::name("queue", queue)?;
    let after = validate::aging_bound(after)?;
    let limit = check_count(limit)?;
    Ok(age_batch(conn, queue, after, limit)?.1)
}

/// One aging call, validated: how many candidates it read (a full batch: call again) and how
/// many it moved (fewer when a claim took some between the read and the change).
pub(crate) fn age_batch<C: TenureConnection>(
    conn: &mut C,
    queue: &str,
    after: i64,
    limit: i64,
) -> Result<(usize, usize)> {
    if in_transaction(conn) {
        return Err(Error::InTransaction {
            operation: "age_priorities",
        });
    }
    retry_transient(|| {
        dispatch!(conn, c => {
            let syntax = c.syntax();
            let ids = ids_of(
                statement(syntax.render(AGED_CANDIDATES))
                    .bind::<Text, _>(queue)
                    .bind::<Integer, _>(AGED_PRIORITY)
                    .bind::<BigInt, _>(-after)
                    .bind::<BigInt, _>(limit)
                    .load::<IdRow>(c)?,
            );
            if ids.is_empty() {
                return Ok((0, 0));
            }
            let read = ids.len();
            let moved = statement(syntax.render(AGE))
                .bind::<Integer, _>(AGED_PRIORITY)
                .bind::<Integer, _>(AGED_PRIORITY)
                .bind::<BigInt, _>(-after)
                .bind_ids(ids)
                .execute(c)?;
            Ok((read, moved))
        })
    })
}

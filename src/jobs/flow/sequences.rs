//! Sequences: strict order per key. A job enqueued with a sequence key
//! ([`crate::jobs::NewJob::sequence`]) waits, blocked, for the job enqueued before it with
//! that key to complete, so the jobs of a key run one at a time in the order they were
//! enqueued: a retrying, snoozed or delayed job holds the rest back, since it has not
//! completed.
//!
//! Per key, `tenure_sequences` holds the last job enqueued with it; each enqueue locks that row
//! (so enqueues of one key are ordered by it), makes the new job depend on the last one if
//! that one has not completed (a dependency edge: the same machinery that releases a
//! dependent exactly once, in the transaction that completes its dependency), and records
//! itself as the last. Claims are unchanged: a blocked job is never claimable.
//!
//! When a job of a sequence ends dead or cancelled, the enqueuer's [`SequenceFailure`] says
//! what the next does: wait until it completes after all (an operator's
//! [`crate::jobs::retry_dead`]) or is let go ([`crate::jobs::skip_in_sequence`]), or go on.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use crate::backend::statement::statement;
use crate::backend::{Dialect, Upsert, dispatch};
use crate::{Result, TenureConnection};

/// What the jobs after a sequence's dead or cancelled job do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum SequenceFailure {
    /// They wait (blocked) until it completes after all ([`crate::jobs::retry_dead`] runs it
    /// again) or an operator lets them go on ([`crate::jobs::skip_in_sequence`]). The
    /// default: nothing runs out of order unseen.
    #[default]
    Hold,
    /// They go on as if it had completed.
    Continue,
}

/// The `run_when` of a held sequence's edge (`tenure_job_dependencies.run_when`): counted
/// down only by its predecessor's completion; a death or a cancel leaves it pending.
pub(crate) const SEQUENCE_HOLD: &str = "sequence_hold";

/// The `run_when` of a going-on sequence's edge: counted down by its predecessor's end,
/// however it ended (as `all_finished`, told apart from a workflow's; 16 bytes at most, the
/// column's width on MySQL).
pub(crate) const SEQUENCE_CONTINUE: &str = "sequence_go_on";

const ENSURE_ON_CONFLICT: &str = "\
    INSERT INTO tenure_sequences (sequence_key, last_job_id) VALUES (?, 0) \
    ON CONFLICT (sequence_key) DO NOTHING";
const ENSURE_ON_DUPLICATE_KEY: &str = "\
    INSERT INTO tenure_sequences (sequence_key, last_job_id) VALUES (?, 0) \
    ON DUPLICATE KEY UPDATE sequence_key = sequence_key";
/// SQLite's IMMEDIATE transaction holds the database's write lock: no row lock needed.
const LAST_JOB: &str =
    "SELECT last_job_id AS id FROM tenure_sequences WHERE sequence_key = ?{for_update}";
const ADVANCE: &str = "UPDATE tenure_sequences SET last_job_id = ? WHERE sequence_key = ?";

#[derive(QueryableByName)]
struct LastJob {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Locks `key`'s row (made if new) and returns the last job enqueued with it (`None`: the
/// first). In the enqueue's transaction: the lock orders this key's enqueues until it
/// commits.
pub(crate) fn lock_last<C: TenureConnection>(conn: &mut C, key: &str) -> Result<Option<i64>> {
    let last = dispatch!(conn, c => {
        let syntax = c.syntax();
        let ensure = match syntax.upsert {
            Upsert::OnConflictWhere => ENSURE_ON_CONFLICT,
            Upsert::OnDuplicateKey => ENSURE_ON_DUPLICATE_KEY,
        };
        statement(ensure).bind::<Text, _>(key).execute(c)?;
        statement(syntax.render(LAST_JOB))
            .bind::<Text, _>(key)
            .get_result::<LastJob>(c)
    })?;
    Ok((last.id > 0).then_some(last.id))
}

/// Records `id` as the last job of `key` (whose row [`lock_last`] locked).
pub(crate) fn advance<C: TenureConnection>(conn: &mut C, key: &str, id: i64) -> Result<()> {
    dispatch!(conn, c => {
        statement(ADVANCE)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(key)
            .execute(c)
    })?;
    Ok(())
}

//! The edges of sequences ([`crate::jobs::NewJob::sequence`]) where they differ from a
//! workflow's: an operator letting a held sequence go on past its dead or cancelled job, and a
//! job cancelled before it ran taken out of its sequence. Counting and releasing are
//! `dependencies`'.

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer};

use super::dependencies::{PendingEdge, count_down, release};
use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::{Error, Result, TenureConnection};

/// The held edges of a dead or cancelled job, under their rows' locks.
const HELD_EDGES: &str = "\
    SELECT job_id, depends_on, stripe, run_when FROM tenure_job_dependencies \
    WHERE depends_on = ? AND counted = 0 AND run_when = 'sequence_hold' ORDER BY job_id{for_update}";
const COUNT_EDGE: &str = "UPDATE tenure_job_dependencies SET counted = 1 WHERE job_id = ? AND depends_on = ?{in_transaction}";

/// The pending sequence edge of a job (to the job before it in its sequence), if any.
const PENDING_SEQUENCE_EDGE: &str = "\
    SELECT depends_on AS id FROM tenure_job_dependencies \
    WHERE job_id = ? AND counted = 0 AND run_when IN ('sequence_hold', 'sequence_go_on')";
/// The sequence edges of the jobs after `id`, moved to the job before it.
const REPOINT_SEQUENCE_EDGES: &str = "\
    UPDATE tenure_job_dependencies SET depends_on = ? \
    WHERE depends_on = ? AND counted = 0 AND run_when IN ('sequence_hold', 'sequence_go_on')";
const ADD_DEPENDENTS: &str = "UPDATE tenure_jobs SET dependents = dependents + ? WHERE id = ?";
/// A key whose last job was taken out: the job before it is its last again. By the key (the
/// primary key), not by `last_job_id`, which no index serves.
const MOVE_LAST_BACK: &str = "\
    UPDATE tenure_sequences SET last_job_id = ? \
    WHERE sequence_key = (SELECT sequence_key FROM tenure_jobs WHERE id = ?) AND last_job_id = ?";

/// Takes the job `id`, cancelled (by the caller's transaction, holding its row's lock) while
/// it still waited for the job before it in its sequence, out of the sequence: the jobs
/// after it (and the key's next enqueue) wait for that job instead. Without this, the job
/// after it counted its cancel as its predecessor's end and ran beside, or before, a job
/// enqueued ahead of it. A job that never waited in a sequence is left alone.
pub(crate) fn splice_out_of_sequence<C: TenureConnection>(conn: &mut C, id: i64) -> Result<()> {
    dispatch!(conn, c => {
        let Some(before) = statement(PENDING_SEQUENCE_EDGE)
            .bind::<BigInt, _>(id)
            .get_result::<crate::rows::IdRow>(c)
            .optional()?
        else {
            return Ok(());
        };
        let moved = statement(REPOINT_SEQUENCE_EDGES)
            .bind::<BigInt, _>(before.id)
            .bind::<BigInt, _>(id)
            .execute(c)?;
        if moved > 0 {
            statement(ADD_DEPENDENTS)
                .bind::<Integer, _>(moved as i32)
                .bind::<BigInt, _>(before.id)
                .execute(c)?;
        }
        statement(MOVE_LAST_BACK)
            .bind::<BigInt, _>(before.id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .execute(c)?;
        Ok::<(), Error>(())
    })
}

/// Lets the jobs a held sequence keeps waiting for the dead or cancelled job `id` (locked by
/// the caller) go on, as if it had completed; returns the queues of those it released.
pub(crate) fn let_held_go<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<String>> {
    let edges = dispatch!(conn, c => {
        statement(c.syntax().render(HELD_EDGES))
            .bind::<BigInt, _>(id)
            .load::<PendingEdge>(c)
    })?;
    let mut queues = Vec::new();
    for edge in edges {
        dispatch!(conn, c => {
            if statement(c.syntax().render(COUNT_EDGE))
                .bind::<BigInt, _>(edge.job_id)
                .bind::<BigInt, _>(edge.depends_on)
                .execute(c)? != 1
            {
                return Err(Error::RolledBackUnderUs { operation: "skip_in_sequence" });
            }
            Ok::<(), Error>(())
        })?;
        if count_down(conn, edge.job_id, &BTreeMap::from([(edge.stripe, 1)]))? {
            queues.extend(release(conn, edge.job_id)?);
        }
    }
    crate::wake::notify(conn, queues.iter().map(String::as_str))?;
    Ok(queues)
}

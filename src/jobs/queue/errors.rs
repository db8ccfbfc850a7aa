//! A failed run's error in its job's history (trimmed to the newest [`MAX_ERROR_HISTORY`]),
//! and error texts made storable on every backend.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};

use super::MAX_ERROR_HISTORY;
use crate::backend::statement::statement;
use crate::backend::{Dialect, dispatch};
use crate::rows::IdRow;
use crate::{Error, Result, TenureConnection};

/// A run that ended its job (dead) failed when the job finished: the same instant in the
/// history as on the job, not the next statement's clock.
const RECORD_ERROR: &str = "\
    INSERT INTO tenure_job_errors (job_id, attempt, error, failed_at) \
    SELECT id, COALESCE(?, attempt), ?, \
        CASE WHEN state = 'dead' AND finished_at IS NOT NULL THEN finished_at ELSE {now} END \
    FROM tenure_jobs WHERE id = ?";

/// The id of the newest error past the [`MAX_ERROR_HISTORY`] a job's history keeps (the
/// offset is bound): it and older ones go. A
/// plain read, then a delete by range (in one statement, MySQL's subquery of the delete
/// takes shared locks on the index, and two trims deadlocked in the rescue race test).
const ERROR_CUTOFF: &str = "\
    SELECT id FROM tenure_job_errors WHERE job_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?";
const TRIM_ERRORS: &str = "DELETE FROM tenure_job_errors WHERE job_id = ? AND id <= ?";

/// Keeps the error of a failed run in the job's history (`attempt` None: the job's current
/// attempt), then trims the history to the newest [`MAX_ERROR_HISTORY`] entries.
pub(crate) fn record_error<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    attempt: Option<i32>,
    error: &str,
) -> Result<()> {
    dispatch!(conn, c => {
        let syntax = c.syntax();
        statement(syntax.render(RECORD_ERROR))
            .bind::<Nullable<Integer>, _>(attempt)
            .bind::<Text, _>(error)
            .bind::<BigInt, _>(id)
            .execute(c)?;
        let cutoff = statement(syntax.render(ERROR_CUTOFF))
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(MAX_ERROR_HISTORY as i64)
            .get_result::<IdRow>(c)
            .optional()?;
        if let Some(cutoff) = cutoff {
            statement(syntax.render(TRIM_ERRORS))
                .bind::<BigInt, _>(id)
                .bind::<BigInt, _>(cutoff.id)
                .execute(c)?;
        }
        Ok::<(), Error>(())
    })
}

/// An error message any backend can store: PostgreSQL's text refuses NUL, which a panic
/// message or an error from C can hold; it becomes U+FFFD, the replacement character.
pub(crate) fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// Cuts `text` to at most `max` bytes at a character boundary.
pub(crate) fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

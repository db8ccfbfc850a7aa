//! A park's deadline: past it (database clock) the job fails as [`super::fail_parked`]
//! would, done by every worker's maintenance.

use diesel::prelude::*;
use diesel::sql_types::BigInt;

use super::answer::{Answer, apply, mark};
use super::answers;
use super::park::load_park;
use crate::backend::statement::statement;
use crate::backend::transaction::retrying_transaction;
use crate::backend::{Dialect, dispatch};
use crate::jobs::JobState;
use crate::jobs::queue::check_count;
use crate::jobs::queue::finish::lock_state;
use crate::rows::IdRow;
use crate::{Result, TenureConnection};

/// The error a park past its deadline leaves in the job's history.
pub(crate) const DEADLINE_PASSED: &str = "parked past its deadline: no answer came";

/// Open parks past their deadline, oldest first, each decided again under its job's lock.
/// Jobs still running (a run that parked and has not returned) are left out: a pass that
/// read them could only skip them, and a hundred such runs filled every pass, so no other
/// park ever expired.
const PAST_DEADLINE: &str = "\
    SELECT p.job_id AS id FROM tenure_parked p JOIN tenure_jobs j ON j.id = p.job_id \
    WHERE p.answered_at IS NULL AND p.deadline <= {now} AND j.state <> 'running' \
    ORDER BY p.deadline LIMIT ?";

/// Is it still past (database clock), read under the job's lock?
const STILL_PAST: &str = "\
    SELECT job_id AS id FROM tenure_parked \
    WHERE job_id = ? AND answered_at IS NULL AND deadline <= {now}";

/// Whether job `id`'s open park is past its deadline by the database's clock (read under the
/// job's lock).
pub(super) fn past_deadline<C: TenureConnection>(conn: &mut C, id: i64) -> Result<bool> {
    let past: Option<IdRow> = dispatch!(conn, c => {
        statement(c.syntax().render(STILL_PAST))
            .bind::<BigInt, _>(id)
            .get_result::<IdRow>(c)
            .optional()
    })?;
    Ok(past.is_some())
}

/// Fails parked jobs whose deadline passed by the database's clock, up to `max_jobs` per
/// call: each is retried after the backoff recorded when it parked while attempts remain,
/// else dead, with the error "parked past its deadline". Returns their ids. Each job in a
/// transaction of its own, its row locked first: an answer racing the deadline either comes
/// first (the job is no longer parked here) or finds it no longer parked
/// ([`ParkRefusal::NotParked`](super::ParkRefusal::NotParked)), never both. Workers call this
/// every second; a program without a worker can call it itself.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobState, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let parked = jobs::enqueue_parked(&mut conn, &NewJob::new("q", "k", vec![]), Duration::ZERO)?;
/// assert_eq!(jobs::expire_parked(&mut conn, 100)?, vec![parked.id]);
/// assert_eq!(jobs::get(&mut conn, parked.id)?.unwrap().state, JobState::Waiting);
/// # Ok(()) }
/// ```
pub fn expire_parked<C: TenureConnection>(conn: &mut C, max_jobs: usize) -> Result<Vec<i64>> {
    let max_jobs = check_count(max_jobs)?;
    let candidates: Vec<IdRow> = dispatch!(conn, c => {
        statement(c.syntax().render(PAST_DEADLINE))
            .bind::<BigInt, _>(max_jobs)
            .load::<IdRow>(c)
    })?;
    let mut expired = Vec::new();
    let mut woken: Vec<String> = Vec::new();
    for IdRow { id } in candidates {
        let done = retrying_transaction(conn, |conn| {
            let Some(row) = lock_state(conn, id)? else {
                return Ok(None);
            };
            if !past_deadline(conn, id)? {
                return Ok(None);
            }
            let Some(park) = load_park(conn, id)? else {
                return Ok(None);
            };
            let same_run = park.claim_token == row.claim_token;
            match JobState::parse(&row.state)? {
                JobState::Parked if same_run => {
                    let queues = apply(conn, &row, &park, &Answer::Fail(DEADLINE_PASSED))?;
                    mark(conn, id, answers::EXPIRED, None, Some(DEADLINE_PASSED))?;
                    Ok(Some(queues))
                }
                // Its run has not returned: once the worker records it parked, a later pass
                // expires it.
                JobState::Running if same_run && park.claim_token.is_some() => Ok(None),
                // Cancelled, or its run ended another way: the park is closed.
                _ => {
                    mark(conn, id, answers::DROPPED, None, None)?;
                    Ok(None)
                }
            }
        })?;
        if let Some(queues) = done {
            expired.push(id);
            woken.extend(queues);
        }
    }
    if !expired.is_empty() {
        crate::wake::wake(woken.iter().map(String::as_str));
        crate::jobs::queue::wait::ended();
    }
    Ok(expired)
}

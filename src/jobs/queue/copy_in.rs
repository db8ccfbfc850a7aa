//! Bulk enqueue by COPY on PostgreSQL: a batch of plain jobs (no dedup key, no
//! dependencies) streamed in PostgreSQL's binary COPY format instead of multi-row INSERTs,
//! which spend most of their time parsing and binding thousands of parameters.
//!
//! COPY returns no ids, so they are taken first from the table's identity sequence (one
//! `nextval` per job, in one statement) and written explicitly; the jobs get them in order.
//! The due and creation times are the database's clock, read once in the same transaction
//! (what the INSERT's `statement_timestamp()` would have given, to the statement).

use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;

use super::NewJob;
use super::enqueue::unexpected;
use crate::backend::statement::statement;
use crate::rows::IdRow;
use crate::schema::tenure_jobs;
use crate::sql_types::InstantValue;
use crate::{Error, Result};

/// Batches at least this long go by COPY; shorter ones are cheaper as one INSERT.
pub(crate) const COPY_MIN_ROWS: usize = 64;

/// Whether this session may take ids from the identity sequence itself, and the database's
/// clock, in one statement. An INSERT's identity default needs only INSERT on the table; an
/// explicit `nextval` needs USAGE or UPDATE on the sequence, which an application user
/// granted only table privileges lacks.
const START: &str = "SELECT coalesce(has_sequence_privilege(\
    pg_get_serial_sequence('tenure_jobs', 'id'), 'USAGE, UPDATE'), false) AS may_take_ids, \
    statement_timestamp() AS now";

/// Ids for `n` new jobs, ascending. The sequence is looked up once (materialized): in the
/// select list, `pg_get_serial_sequence` ran for every id, 20 ms of 10,000 where `nextval`
/// alone takes 2 ms, a fifth of a bulk's time on the server.
const TAKE_IDS: &str = "WITH s AS MATERIALIZED \
    (SELECT pg_get_serial_sequence('tenure_jobs', 'id')::regclass AS seq) \
    SELECT nextval(s.seq) AS id FROM s, generate_series(1, ?) ORDER BY 1";

#[derive(QueryableByName)]
struct Start {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    may_take_ids: bool,
    #[diesel(sql_type = crate::sql_types::Instant)]
    now: DateTime<Utc>,
}

#[derive(Insertable)]
#[diesel(table_name = tenure_jobs, treat_none_as_default_value = false)]
struct CopyRow<'a> {
    id: i64,
    queue: &'a str,
    kind: &'a str,
    payload: &'a [u8],
    priority: i32,
    state: &'a str,
    attempt: i32,
    max_attempts: i32,
    due_at: InstantValue,
    created_at: InstantValue,
    limit_key: Option<&'a str>,
    limit_max: Option<i32>,
    workflow_id: Option<i64>,
}

/// Whether `jobs` go by COPY: long enough, and every one plain (a dedup key needs the
/// upsert, a dependency its edges, a fair job its stamp: a column `tenure::schema` leaves
/// out, which diesel's COPY cannot write).
pub(crate) fn wanted(jobs: &[NewJob]) -> bool {
    jobs.len() >= COPY_MIN_ROWS
        && jobs.iter().all(|job| {
            job.dedup_key.is_none() && job.dependencies.is_empty() && job.fair_key.is_none()
        })
}

/// Inserts `jobs` (all plain: see [`wanted`]) by COPY in the connection's transaction and
/// returns their ids, in the jobs' order; `None` (nothing done) where the session may not
/// take ids from the sequence: the caller inserts them as usual.
pub(crate) fn copy_jobs(conn: &mut PgConnection, jobs: &[NewJob]) -> Result<Option<Vec<i64>>> {
    let Start { may_take_ids, now } = statement(START).get_result::<Start>(conn)?;
    if !may_take_ids {
        return Ok(None);
    }
    let n = i64::try_from(jobs.len()).map_err(|_| Error::invalid("jobs", "too many"))?;
    let ids: Vec<i64> = statement(TAKE_IDS)
        .bind::<BigInt, _>(n)
        .load::<IdRow>(conn)?
        .into_iter()
        .map(|row| row.id)
        .collect();
    if ids.len() != jobs.len() {
        return Err(unexpected(format!(
            "{} ids taken for {} jobs",
            ids.len(),
            jobs.len()
        )));
    }
    let rows: Vec<CopyRow<'_>> = ids
        .iter()
        .zip(jobs)
        .map(|(&id, job)| {
            let (at, delay_micros) = job.due_params();
            let (limit_key, limit_max) = job.first_limit();
            CopyRow {
                id,
                queue: &job.queue,
                kind: &job.kind,
                payload: &job.payload,
                priority: job.priority,
                state: "waiting",
                attempt: 0,
                max_attempts: job.max_attempts as i32,
                due_at: InstantValue(
                    at.unwrap_or_else(|| now + chrono::TimeDelta::microseconds(delay_micros)),
                ),
                created_at: InstantValue(now),
                limit_key,
                limit_max,
                workflow_id: job.workflow_id,
            }
        })
        .collect();
    let copied = diesel::copy_from(tenure_jobs::table)
        .from_insertable(&rows)
        .execute(conn)?;
    if copied != jobs.len() {
        return Err(unexpected(format!(
            "{copied} rows copied for {} jobs",
            jobs.len()
        )));
    }
    Ok(Some(ids))
}

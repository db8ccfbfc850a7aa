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

/// Whether this session may take ids from the identity sequence itself, the database's
/// clock and the job slot new jobs go to, in one statement. An INSERT's identity default
/// needs only INSERT on the table; an explicit `nextval` needs USAGE or UPDATE on the
/// sequence, which an application user granted only table privileges lacks.
const START: &str = "SELECT coalesce(has_sequence_privilege(\
    pg_get_serial_sequence('tenure_jobs', 'id'), 'USAGE, UPDATE'), false) AS may_take_ids, \
    statement_timestamp() AS now, \
    pg_sequence_last_value('tenure_jobs_slot'::regclass) AS slot";

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
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    slot: Option<i64>,
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

/// The job slots' partitions (`tenure-0056`), for a COPY into the current one by name: through
/// the partitioned parent each row is routed and its slot's default (a read of the slot
/// sequence) evaluated, a tenth of the bulk's time on the server; the slot is read once here.
/// Each slot has the parent's statement trigger for the ready ring's entries of its own (a
/// parent's statement trigger fires only for statements that name the parent).
macro_rules! slot_copy {
    ($($slot:literal => $table:ident, $row:ident;)*) => {
        $(
            diesel::table! {
                use diesel::sql_types::*;
                use crate::sql_types::Instant;
                $table (id) {
                    id -> BigInt,
                    queue -> Text,
                    kind -> Text,
                    payload -> Binary,
                    priority -> Integer,
                    state -> Text,
                    attempt -> Integer,
                    max_attempts -> Integer,
                    due_at -> Instant,
                    created_at -> Instant,
                    limit_key -> Nullable<Text>,
                    limit_max -> Nullable<Integer>,
                    workflow_id -> Nullable<BigInt>,
                    slot -> SmallInt,
                }
            }

            #[derive(Insertable)]
            #[diesel(table_name = $table, treat_none_as_default_value = false)]
            struct $row<'a> {
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
                slot: i16,
            }

            impl<'a> From<CopyRow<'a>> for $row<'a> {
                fn from(r: CopyRow<'a>) -> Self {
                    $row {
                        id: r.id,
                        queue: r.queue,
                        kind: r.kind,
                        payload: r.payload,
                        priority: r.priority,
                        state: r.state,
                        attempt: r.attempt,
                        max_attempts: r.max_attempts,
                        due_at: r.due_at,
                        created_at: r.created_at,
                        limit_key: r.limit_key,
                        limit_max: r.limit_max,
                        workflow_id: r.workflow_id,
                        slot: $slot,
                    }
                }
            }
        )*

        /// COPYs `rows` into slot `slot`'s partition (through the parent for any other
        /// value, which the sequence never holds).
        fn copy_rows(
            conn: &mut PgConnection,
            slot: Option<i64>,
            rows: Vec<CopyRow<'_>>,
        ) -> Result<usize> {
            Ok(match slot {
                $(
                    Some($slot) => {
                        let rows: Vec<$row<'_>> = rows.into_iter().map(Into::into).collect();
                        diesel::copy_from($table::table).from_insertable(&rows).execute(conn)?
                    }
                )*
                _ => diesel::copy_from(tenure_jobs::table).from_insertable(&rows).execute(conn)?,
            })
        }
    };
}

slot_copy! {
    0 => tenure_jobs_0, SlotRow0;
    1 => tenure_jobs_1, SlotRow1;
    2 => tenure_jobs_2, SlotRow2;
    3 => tenure_jobs_3, SlotRow3;
    4 => tenure_jobs_4, SlotRow4;
    5 => tenure_jobs_5, SlotRow5;
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
    let Start {
        may_take_ids,
        now,
        slot,
    } = statement(START).get_result::<Start>(conn)?;
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
    let copied = copy_rows(conn, slot, rows)?;
    if copied != jobs.len() {
        return Err(unexpected(format!(
            "{copied} rows copied for {} jobs",
            jobs.len()
        )));
    }
    Ok(Some(ids))
}

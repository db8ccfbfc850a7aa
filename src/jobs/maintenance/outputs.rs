//! What a run printed (`tenure_job_outputs`): the tail of a run's output and its exit code,
//! kept with the job (shell jobs of the `tenure` command record them) and deleted with it
//! when it is pruned.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Nullable};

use crate::backend::statement::statement;
use crate::backend::transaction::write_turn;
use crate::backend::{Dialect, dispatch};
use crate::{Result, TenureConnection};

/// What one run printed and how it ended, from [`outputs`]: the model of a
/// `tenure_job_outputs` row ([`crate::schema::tenure_job_outputs`]).
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = crate::schema::tenure_job_outputs)]
pub struct RunOutput {
    /// Which run.
    pub attempt: i32,
    /// Its exit code, if it exited with one.
    pub exit_code: Option<i32>,
    /// What it printed (at most [`MAX_OUTPUT_BYTES`]).
    pub output: Vec<u8>,
    /// When it was recorded (database clock).
    pub finished_at: DateTime<Utc>,
}

/// The most output kept per run; longer output keeps its last bytes.
pub const MAX_OUTPUT_BYTES: usize = 64 * 1024;

const RECORD_OUTPUT: &str = "\
    INSERT INTO tenure_job_outputs (job_id, attempt, exit_code, output, finished_at) \
    VALUES (?, ?, ?, ?, {now})";

/// Keeps what a run of job `id` printed and its exit code with the job (the tail of the
/// output, at most [`MAX_OUTPUT_BYTES`]). Joins the caller's transaction if there is one.
/// Outputs are deleted with their job when it is pruned.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob};
/// # let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// # tenure::run_migrations(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("ops", "shell", vec![]))?.id;
/// jobs::record_output(&mut conn, id, 1, Some(0), b"backup done\n")?;
/// let runs = jobs::outputs(&mut conn, id)?;
/// assert_eq!((runs[0].exit_code, runs[0].output.as_slice()), (Some(0), &b"backup done\n"[..]));
/// # Ok(()) }
/// ```
pub fn record_output<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    attempt: u32,
    exit_code: Option<i32>,
    output: &[u8],
) -> Result<()> {
    let tail = &output[output.len().saturating_sub(MAX_OUTPUT_BYTES)..];
    // SQLite: this process's writers take turns (see `tenure::transaction`).
    let _turn = write_turn(conn)?;
    dispatch!(conn, c => {
        statement(c.syntax().render(RECORD_OUTPUT))
            .bind::<BigInt, _>(id)
            .bind::<Integer, _>(attempt as i32)
            .bind::<Nullable<Integer>, _>(exit_code)
            .bind::<diesel::sql_types::Binary, _>(tail)
            .execute(c)
    })?;
    Ok(())
}

/// The recorded outputs of job `id`'s runs, oldest first.
pub fn outputs<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<RunOutput>> {
    use crate::schema::tenure_job_outputs;
    Ok(dispatch!(conn, c => {
        tenure_job_outputs::table
            .filter(tenure_job_outputs::job_id.eq(id))
            .order(tenure_job_outputs::id)
            .select(RunOutput::as_select())
            .load(c)
    })?)
}

//! What runs leave for others to read: a completed job's result (`tenure_job_results`), and a
//! running job's progress.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Double, Nullable, Text};

use crate::backend::dispatch;
use crate::backend::statement::statement;
use crate::jobs::queue::errors::storable;
use crate::jobs::{JobClaim, JobState, MAX_BATCH, Outcome};
use crate::schema::{tenure_job_dependencies, tenure_job_results, tenure_jobs};
use crate::sql_types::Token;
use crate::{Error, Result, TenureConnection, transaction};

/// The largest result, in bytes.
pub const MAX_RESULT_BYTES: usize = 1024 * 1024;
/// Longer progress messages are cut to this many bytes (at a character boundary).
pub const MAX_PROGRESS_MESSAGE_BYTES: usize = 256;

/// What a completed job's handler returned for its dependents and callbacks to read: JSON or
/// bytes, at most [`MAX_RESULT_BYTES`]. Kept with the job, deleted with it.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::JobResult;
/// let result = JobResult::json(&serde_json::json!({"rows": 42}))?;
/// assert_eq!(result.decode::<serde_json::Value>()?["rows"], 42);
/// assert_eq!(JobResult::bytes(vec![1, 2])?.as_bytes(), &[1, 2]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobResult {
    json: bool,
    body: Vec<u8>,
}

impl JobResult {
    /// `value` as JSON; [`crate::Error::InvalidInput`] if it cannot be written as JSON or is
    /// longer than [`MAX_RESULT_BYTES`].
    pub fn json<T: serde::Serialize + ?Sized>(value: &T) -> Result<JobResult> {
        let body = serde_json::to_vec(value)
            .map_err(|e| Error::invalid("result", format!("cannot be written as JSON: {e}")))?;
        JobResult::checked(true, body)
    }

    /// Bytes; [`crate::Error::InvalidInput`] if longer than [`MAX_RESULT_BYTES`].
    pub fn bytes(body: impl Into<Vec<u8>>) -> Result<JobResult> {
        JobResult::checked(false, body.into())
    }

    fn checked(json: bool, body: Vec<u8>) -> Result<JobResult> {
        if body.len() > MAX_RESULT_BYTES {
            return Err(Error::invalid(
                "result",
                format!("is {} bytes, the limit is {MAX_RESULT_BYTES}", body.len()),
            ));
        }
        Ok(JobResult { json, body })
    }

    /// Whether it is JSON.
    pub fn is_json(&self) -> bool {
        self.json
    }

    /// Its bytes (JSON text for a JSON result).
    pub fn as_bytes(&self) -> &[u8] {
        &self.body
    }

    /// Decodes a JSON result (bytes are read as JSON too).
    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body)
            .map_err(|e| Error::invalid("result", format!("is not the JSON expected: {e}")))
    }

    pub(crate) fn format(&self) -> &'static str {
        if self.json { "json" } else { "bytes" }
    }

    pub(crate) fn from_row(format: &str, body: Vec<u8>) -> JobResult {
        JobResult {
            json: format == "json",
            body,
        }
    }
}

/// Writes the results of jobs just completed, in the completing transaction.
pub(crate) fn store<C: TenureConnection>(
    conn: &mut C,
    results: &[(i64, &JobResult)],
) -> Result<()> {
    let rows: Vec<_> = results
        .iter()
        .map(|(id, result)| {
            (
                tenure_job_results::job_id.eq(*id),
                tenure_job_results::format.eq(result.format()),
                tenure_job_results::body.eq(result.as_bytes()),
            )
        })
        .collect();
    dispatch!(conn, c => {
        for row in &rows {
            diesel::insert_into(tenure_job_results::table).values(row).execute(c)?;
        }
        Ok::<(), Error>(())
    })
}

/// Completes one claimed job with a result, in one transaction (the caller's, if one is
/// open): the result is there as soon as the job is completed, for the dependents its
/// completion releases. [`crate::Error::InvalidInput`] for a result too long, before
/// anything is written.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobResult, NewJob, Outcome};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("q", "count", vec![]))?.id;
/// let job = jobs::claim(&mut conn, "q", 1, Duration::from_secs(60))?.remove(0);
/// let outcome = jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json(&7)?)?;
/// assert_eq!(outcome, Outcome::Done);
/// assert_eq!(jobs::result(&mut conn, id)?.unwrap().decode::<i32>()?, 7);
/// # Ok(()) }
/// ```
pub fn complete_with_result<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
    result: &JobResult,
) -> Result<Outcome> {
    let outcomes =
        crate::jobs::queue::finish::complete_with_results(conn, &[claim], &[(claim.id, result)])?;
    Ok(outcomes.first().copied().unwrap_or(Outcome::Lost))
}

/// A completed job's result, or `None` (no result, or no such job). See
/// [`complete_with_result`] for an example.
pub fn result<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<JobResult>> {
    let row: Option<(String, Vec<u8>)> = dispatch!(conn, c => {
        tenure_job_results::table
            .find(id)
            .select((tenure_job_results::format, tenure_job_results::body))
            .get_result(c)
            .optional()
    })?;
    Ok(row.map(|(format, body)| JobResult::from_row(&format, body)))
}

/// One of a job's dependencies, from [`dependency_results`].
#[derive(Debug, Clone, PartialEq)]
pub struct DependencyResult {
    /// The dependency's id.
    pub id: i64,
    /// Its kind.
    pub kind: String,
    /// Its state.
    pub state: JobState,
    /// Its result, if it completed with one.
    pub result: Option<JobResult>,
}

#[derive(QueryableByName)]
struct DependencyRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    kind: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<Text>)]
    format: Option<String>,
    #[diesel(sql_type = Nullable<Binary>)]
    body: Option<Vec<u8>>,
}

const DEPENDENCY_RESULTS: &str = "\
    SELECT j.id, j.kind, j.state, r.format, r.body FROM tenure_jobs j \
    LEFT JOIN tenure_job_results r ON r.job_id = j.id WHERE j.id IN {ids} ORDER BY j.id";

/// The jobs `id` depends on, by id, with their states and results: what a dependent (or a
/// workflow's callback) reads when it runs. Retention never deletes a dependency while a
/// job that depends on it has not finished.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobResult, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let part = jobs::enqueue(&mut conn, &NewJob::new("etl", "fetch", vec![]))?.id;
/// let merge = jobs::enqueue(&mut conn, &NewJob::new("etl", "merge", vec![]).depends_on([part]))?.id;
/// let job = jobs::claim(&mut conn, "etl", 1, Duration::from_secs(60))?.remove(0);
/// jobs::complete_with_result(&mut conn, job.claim(), &JobResult::json(&[1, 2, 3])?)?;
/// let inputs = jobs::dependency_results(&mut conn, merge)?;
/// assert_eq!(inputs[0].result.as_ref().unwrap().decode::<Vec<i32>>()?, vec![1, 2, 3]);
/// # Ok(()) }
/// ```
///
/// It reads every dependency's result at once (up to [`MAX_RESULT_BYTES`] each): for a job
/// that waits for thousands, read them a page at a time with [`dependency_results_after`].
pub fn dependency_results<C: TenureConnection>(
    conn: &mut C,
    id: i64,
) -> Result<Vec<DependencyResult>> {
    let ids: Vec<i64> = dispatch!(conn, c => {
        tenure_job_dependencies::table
            .filter(tenure_job_dependencies::job_id.eq(id))
            .select(tenure_job_dependencies::depends_on)
            .order(tenure_job_dependencies::depends_on)
            .load(c)
    })?;
    results_of(conn, &ids)
}

/// A page of [`dependency_results`]: at most `limit` (1 to [`MAX_BATCH`]) dependencies with
/// ids above `after` (`None`: from the first), by id. Pass the last id of a page as `after`
/// for the next; an empty page is the end.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let parts = jobs::enqueue_many(&mut conn, &vec![NewJob::new("q", "part", vec![]); 5])?;
/// let merge = NewJob::new("q", "merge", vec![]).depends_on(parts.iter().map(|p| p.id));
/// let merge = jobs::enqueue(&mut conn, &merge)?.id;
/// let (mut after, mut seen) = (None, 0);
/// loop {
///     let page = jobs::dependency_results_after(&mut conn, merge, after, 2)?;
///     let Some(last) = page.last() else { break };
///     after = Some(last.id);
///     seen += page.len();
/// }
/// assert_eq!(seen, 5);
/// # Ok(()) }
/// ```
pub fn dependency_results_after<C: TenureConnection>(
    conn: &mut C,
    id: i64,
    after: Option<i64>,
    limit: usize,
) -> Result<Vec<DependencyResult>> {
    let limit = crate::jobs::queue::check_count(limit)?;
    let ids: Vec<i64> = dispatch!(conn, c => {
        tenure_job_dependencies::table
            .filter(tenure_job_dependencies::job_id.eq(id))
            .filter(tenure_job_dependencies::depends_on.gt(after.unwrap_or(i64::MIN)))
            .select(tenure_job_dependencies::depends_on)
            .order(tenure_job_dependencies::depends_on)
            .limit(limit)
            .load(c)
    })?;
    results_of(conn, &ids)
}

/// The jobs `ids` (sorted) with their states and results; jobs pruned meanwhile are left
/// out.
fn results_of<C: TenureConnection>(conn: &mut C, ids: &[i64]) -> Result<Vec<DependencyResult>> {
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(MAX_BATCH) {
        let rows: Vec<DependencyRow> = dispatch!(conn, c => {
            statement(DEPENDENCY_RESULTS).bind_ids(chunk.iter().copied()).load::<DependencyRow>(c)
        })?;
        for row in rows {
            out.push(DependencyResult {
                id: row.id,
                kind: row.kind,
                state: JobState::parse(&row.state)?,
                result: match (row.format, row.body) {
                    (Some(format), Some(body)) => Some(JobResult::from_row(&format, body)),
                    _ => None,
                },
            });
        }
    }
    Ok(out)
}

/// A running job's progress, fenced: written only while this claim holds the job.
const RECORD_PROGRESS: &str = "\
    UPDATE tenure_jobs SET progress = ?, progress_message = ? \
    WHERE id = ? AND claim_token = ? AND state = 'running'";

/// Records a running job's progress (a number, say a fraction or a count, and a short
/// message cut to [`MAX_PROGRESS_MESSAGE_BYTES`]) for others to read
/// ([`crate::jobs::get`]'s `progress`). `Done` if the claim still holds the job, else `Lost`
/// (nothing written). A worker's handlers call [`crate::worker::JobContext::set_progress`]
/// instead, which costs no write per call. A number that is not finite is
/// [`crate::Error::InvalidInput`].
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob, Outcome};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let id = jobs::enqueue(&mut conn, &NewJob::new("q", "import", vec![]))?.id;
/// let job = jobs::claim(&mut conn, "q", 1, Duration::from_secs(60))?.remove(0);
/// assert_eq!(jobs::record_progress(&mut conn, job.claim(), 0.5, "half way")?, Outcome::Done);
/// assert_eq!(jobs::get(&mut conn, id)?.unwrap().progress, Some(0.5));
/// # Ok(()) }
/// ```
pub fn record_progress<C: TenureConnection>(
    conn: &mut C,
    claim: JobClaim,
    value: f64,
    message: &str,
) -> Result<Outcome> {
    if !value.is_finite() {
        return Err(Error::invalid(
            "progress",
            format!("{value} is not a finite number"),
        ));
    }
    let message = storable(message);
    let message = crate::jobs::queue::errors::truncate(&message, MAX_PROGRESS_MESSAGE_BYTES);
    let changed = transaction(conn, |conn| {
        dispatch!(conn, c => {
            statement(RECORD_PROGRESS)
                .bind::<Double, _>(value)
                .bind::<Text, _>(message)
                .bind::<BigInt, _>(claim.id)
                .bind::<Token, _>(claim.token)
                .execute(c)
        })
    })?;
    Ok(if changed == 1 {
        Outcome::Done
    } else {
        Outcome::Lost
    })
}

/// A job's progress as last recorded: (number, message). See [`record_progress`] for an
/// example.
pub fn progress<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<(f64, String)>> {
    let row: Option<(Option<f64>, Option<String>)> = dispatch!(conn, c => {
        tenure_jobs::table
            .find(id)
            .select((tenure_jobs::progress, tenure_jobs::progress_message))
            .get_result(c)
            .optional()
    })?;
    Ok(row.and_then(|(value, message)| value.map(|v| (v, message.unwrap_or_default()))))
}

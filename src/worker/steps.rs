//! [`JobContext::step`]: a handler's durable steps, run once per job across its retries.

use std::sync::PoisonError;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{JobContext, JobError};
use crate::jobs::{StepError, decode_step, run_step, run_unfenced_step};
use crate::{AnyConnection, Error, validate};

impl JobContext {
    /// Runs step `name` of this job once across all its runs: a retry (a later run of the
    /// job, after a failure, a crash or a kill) gets the step's stored result back and `f`
    /// does not run again, so a long handler made of steps resumes after the last step that
    /// completed.
    ///
    /// `f` gets a connection (from the worker's pool) inside a transaction of tenure's kind
    /// ([`crate::transaction`]); in that one transaction the step's result (`T`, as JSON, at
    /// most [`MAX_RESULT_BYTES`](crate::jobs::MAX_RESULT_BYTES)) is stored and the run's
    /// claim is checked under a lock of the job's row. So `f`'s own writes on that connection
    /// and the step's result commit together, only while this run holds the job, or not at
    /// all: what `f` writes to the same database happens exactly once per job.
    /// Writes elsewhere (a file, an HTTP call) happen at least once: a run killed after them
    /// and before the commit runs `f` again.
    ///
    /// - `f` fails: [`StepError::Failed`] with its error (a [`JobError`], or anything that
    ///   converts into one), its writes rolled back, nothing stored; `?` in the handler fails
    ///   the run as that error says (retry per policy, dead, snooze).
    /// - The run lost its claim (it lapsed and the job was rescued or claimed again, or the
    ///   job was asked to cancel): [`Error::ClaimLost`], rolled back; also for a step that is
    ///   stored.
    /// - The result is longer than the limit, not JSON, or does not read back from its JSON
    ///   (a NaN): [`Error::InvalidInput`], rolled back. What the step returns is its result
    ///   as read back from its JSON: what a retry gets.
    ///
    /// `name`: 1 to 255 bytes, no NUL ([`Error::InvalidInput`] before `f` runs). The same
    /// name twice in one run runs `f` once: the second call returns the stored value, so give
    /// each step its own name (a loop's steps: `format!("page-{n}")`). A stored result that no
    /// longer decodes as `T` (the step's type changed) is [`Error::InvalidInput`].
    ///
    /// Steps are kept across retries and across a revival of a dead job
    /// ([`crate::jobs::retry_dead`]: the revived job resumes), and deleted with the job by
    /// retention. Read them with [`crate::jobs::steps`]; `tenure jobs show` lists them. On
    /// SQLite the step's transaction holds the database's write lock while `f` runs: keep
    /// steps short there.
    ///
    /// In a context made for a unit test ([`crate::testing::context`]) there is no job row:
    /// give it a pool with [`crate::testing::with_pool`], and its steps run `f` in a
    /// transaction on it and are kept in the context (a second call, also on a clone of the
    /// context, returns the kept value, as a retry would; of two threads on one name one
    /// keeps it and the other's writes roll back, as in a worker). Without a pool a step is
    /// [`Error::InvalidInput`] and `f` does not run.
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tenure::diesel::{self, RunQueryDsl};
    /// use tenure::worker::{JobContext, JobError, Worker};
    ///
    /// fn import(ctx: &JobContext, file: String) -> Result<(), JobError> {
    ///     let rows: Vec<String> = ctx.step("fetch", |_conn| {
    ///         Ok::<_, JobError>(vec![format!("{file}:1"), format!("{file}:2")])
    ///     })?;
    ///     let stored: usize = ctx.step("store", |conn| {
    ///         for row in &rows {
    ///             diesel::sql_query("INSERT INTO imported (line) VALUES (?)").bind::<diesel::sql_types::Text, _>(row).execute(conn)?;
    ///         }
    ///         Ok::<_, JobError>(rows.len())
    ///     })?;
    ///     ctx.step("notify", |_conn| Ok::<_, JobError>(println!("{stored} rows imported")))?;
    ///     Ok(())
    /// }
    ///
    /// let pool = tenure::Pool::options().max_size(1).open(":memory:")?;
    /// tenure::run_migrations(&mut pool.get()?)?;
    /// diesel::sql_query("CREATE TABLE imported (line TEXT)").execute(&mut pool.get()?)?;
    /// tenure::jobs::enqueue(&mut pool.get()?, &tenure::jobs::NewJob::new("q", "import", br#""a.csv""#.to_vec()))?;
    /// let report = Worker::builder(pool.clone()).queue("q").handler("import", import).drain()?;
    /// assert_eq!(report.completed, 1);
    /// # Ok(()) }
    /// ```
    pub fn step<T, E, F>(&self, name: &str, f: F) -> Result<T, StepError<JobError>>
    where
        T: Serialize + DeserializeOwned,
        E: Into<JobError>,
        F: FnOnce(&mut AnyConnection) -> Result<T, E>,
    {
        let f = |conn: &mut AnyConnection| f(conn).map_err(Into::into);
        let pool = self.pool.0.as_ref();
        if !self.for_test {
            let pool = pool.ok_or_else(|| Error::invalid("context", "has no worker pool"))?;
            let mut conn = pool.get()?;
            return run_step(&mut conn, self.claim, name, f);
        }
        validate::name("step name", name)?;
        let kept = |ctx: &JobContext| {
            ctx.notes
                .test_steps
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(name)
                .cloned()
        };
        if let Some(body) = kept(self) {
            return Ok(decode_step(name, &body)?);
        }
        let pool = pool.ok_or_else(|| {
            Error::invalid(
                "context",
                "was made for a test without a pool: give it one with tenure::testing::with_pool \
                 to run its steps",
            )
        })?;
        let mut conn = pool.get()?;
        let steps = &self.notes.test_steps;
        // Kept before the commit, so that of two threads on one name one keeps it and the
        // other's writes roll back, as two threads of a worker's run store it once.
        let keep = |body: &[u8]| {
            let mut steps = steps.lock().unwrap_or_else(PoisonError::into_inner);
            match steps.get(name) {
                Some(other) => Some(other.clone()),
                None => {
                    steps.insert(name.to_string(), body.to_vec());
                    None
                }
            }
        };
        let unkeep = || {
            steps
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(name);
        };
        run_unfenced_step(&mut conn, name, f, keep, unkeep)
    }
}

/// `?` on a step in a handler: the closure's own error as it was, tenure's as a retry per
/// policy (a lost claim's run is recorded as lost anyway).
impl From<StepError<JobError>> for JobError {
    fn from(error: StepError<JobError>) -> Self {
        match error {
            StepError::Failed(e) => e,
            StepError::Tenure(e) => JobError::retry(format!("step: {e}")),
        }
    }
}

//! Workflows and batches: jobs enqueued together (`tenure_workflows`), some waiting for others,
//! with callback jobs when they all succeed, when the first fails, and when all finished.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use crate::backend::statement::statement;
use crate::backend::transaction::retrying_transaction;
use crate::backend::{Dialect, dispatch};
use crate::jobs::{Enqueued, JobState, NewJob, RunWhen, enqueue_many};
use crate::rows::{IdRow, IdStateRow};
use crate::schema::{tenure_job_dependencies, tenure_jobs, tenure_workflows};
use crate::{Error, Result, TenureConnection, validate};

/// A step of a [`Workflow`], to make later steps depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Step(usize);

/// Jobs enqueued together in one transaction, some waiting for others (a DAG: a step
/// depends only on steps added before it), with optional callback jobs. A *batch* is a
/// workflow of independent steps with callbacks.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob, Workflow};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
///
/// // An ETL: fetch 3 parts, then merge them.
/// let mut etl = Workflow::new("nightly-etl");
/// let parts: Vec<_> = (0..3)
///     .map(|i| etl.add(NewJob::json("etl", "fetch", &i).unwrap()))
///     .collect();
/// etl.add_after(&parts, NewJob::new("etl", "merge", vec![]));
/// etl.on_failure(NewJob::new("etl", "page-someone", vec![]));
/// let enqueued = jobs::enqueue_workflow(&mut conn, &etl)?;
///
/// let status = jobs::workflow_status(&mut conn, enqueued.id)?.unwrap();
/// assert_eq!((status.counts.waiting, status.counts.blocked), (3, 1));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Workflow {
    name: String,
    steps: Vec<(NewJob, Vec<usize>)>,
    on_success: Option<NewJob>,
    on_failure: Option<NewJob>,
    on_finish: Option<NewJob>,
}

/// What [`enqueue_workflow`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueuedWorkflow {
    /// The workflow's id.
    pub id: i64,
    /// The steps' job ids, in the order they were added.
    pub jobs: Vec<i64>,
    /// The callbacks' job ids.
    pub on_success: Option<i64>,
    /// See [`Workflow::on_failure`].
    pub on_failure: Option<i64>,
    /// See [`Workflow::on_finish`].
    pub on_finish: Option<i64>,
}

impl Workflow {
    /// An empty workflow; `name` is for people (the `tenure` command shows it).
    pub fn new(name: impl Into<String>) -> Workflow {
        Workflow {
            name: name.into(),
            steps: Vec::new(),
            on_success: None,
            on_failure: None,
            on_finish: None,
        }
    }

    /// Adds a step that depends on no other step (it may still depend on existing jobs:
    /// [`NewJob::depends_on`]).
    pub fn add(&mut self, job: NewJob) -> Step {
        self.add_after(&[], job)
    }

    /// Adds a step that waits for `after` (steps of this workflow), as its
    /// [`NewJob::run_when`] says.
    pub fn add_after(&mut self, after: &[Step], job: NewJob) -> Step {
        self.steps.push((job, after.iter().map(|s| s.0).collect()));
        Step(self.steps.len() - 1)
    }

    /// A job that runs once every step completed (cancelled if one dies or is cancelled).
    pub fn on_success(&mut self, job: NewJob) -> &mut Self {
        self.on_success = Some(job);
        self
    }

    /// A job that runs once, when the first step dies or is cancelled (cancelled if all
    /// complete).
    pub fn on_failure(&mut self, job: NewJob) -> &mut Self {
        self.on_failure = Some(job);
        self
    }

    /// A job that runs once every step finished, however.
    pub fn on_finish(&mut self, job: NewJob) -> &mut Self {
        self.on_finish = Some(job);
        self
    }

    fn validate(&self) -> Result<()> {
        validate::name("workflow name", &self.name)?;
        if self.steps.is_empty() {
            return Err(Error::invalid("workflow", "has no steps"));
        }
        for (i, (job, after)) in self.steps.iter().enumerate() {
            if let Some(bad) = after.iter().find(|a| **a >= i) {
                return Err(Error::invalid(
                    "workflow",
                    format!("step {i} depends on step {bad}, which is not an earlier step"),
                ));
            }
            if job.dedup_key.is_some() {
                return Err(Error::invalid(
                    "workflow",
                    format!("step {i} has a dedup key (a workflow's steps cannot)"),
                ));
            }
        }
        for job in self.callbacks().map(|(_, job)| job) {
            if job.dedup_key.is_some() {
                return Err(Error::invalid(
                    "workflow",
                    "a callback has a dedup key (a workflow's jobs cannot)",
                ));
            }
        }
        Ok(())
    }

    fn callbacks(&self) -> impl Iterator<Item = (RunWhen, &NewJob)> {
        [
            (RunWhen::AllCompleted, &self.on_success),
            (RunWhen::AnyFailed, &self.on_failure),
            (RunWhen::AllFinished, &self.on_finish),
        ]
        .into_iter()
        .filter_map(|(when, job)| job.as_ref().map(|job| (when, job)))
    }
}

const INSERT_WORKFLOW: &str = "INSERT INTO tenure_workflows (name, created_at) VALUES (?, {now})";

/// Enqueues a workflow in one transaction (the caller's, if one is open: then in a
/// savepoint of it): all of it or none. Steps are inserted in the order added, each
/// `blocked` until its dependencies are settled. Callbacks depend on every step.
/// Invalid input (no steps, a step depending on a later one, a dedup key, an invalid job)
/// is [`Error::InvalidInput`] and writes nothing.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, JobState, NewJob, Workflow};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let mut batch = Workflow::new("import");
/// for row in 0..3 {
///     batch.add(NewJob::json("import", "row", &row)?);
/// }
/// batch.on_finish(NewJob::new("import", "summarize", vec![]));
/// let made = jobs::enqueue_workflow(&mut conn, &batch)?;
/// assert_eq!(made.jobs.len(), 3);
/// let summarize = jobs::get(&mut conn, made.on_finish.unwrap())?.unwrap();
/// assert_eq!((summarize.state, summarize.workflow_id), (JobState::Blocked, Some(made.id)));
/// # Ok(()) }
/// ```
pub fn enqueue_workflow<C: TenureConnection>(
    conn: &mut C,
    workflow: &Workflow,
) -> Result<EnqueuedWorkflow> {
    workflow.validate()?;
    for (job, _) in &workflow.steps {
        job.validate()?;
    }
    for (_, job) in workflow.callbacks() {
        job.validate()?;
    }
    retrying_transaction(conn, |conn| {
        // The jobs outside the workflow that its jobs depend on, locked first and all at
        // once, in id order (see `enqueue::lock_dependencies`).
        let jobs = workflow.steps.iter().map(|(job, _)| job);
        crate::jobs::queue::enqueue::lock_dependencies(
            conn,
            jobs.chain(workflow.callbacks().map(|(_, job)| job)),
        )?;
        let id: i64 = dispatch!(conn, c => {
            let syntax = c.syntax();
            statement(format!("{} RETURNING id", syntax.render(INSERT_WORKFLOW)))
                .bind::<Text, _>(workflow.name.as_str())
                .get_result::<IdRow>(c)
                .map(|row| row.id)
        })?;
        // Steps go in runs: a run ends before a step that depends on a step of it, so every
        // step's dependencies have ids when it is enqueued.
        let mut ids: Vec<i64> = Vec::with_capacity(workflow.steps.len());
        let mut run: Vec<NewJob> = Vec::new();
        for (job, after) in &workflow.steps {
            if after.iter().any(|a| *a >= ids.len()) {
                flush(conn, &mut run, &mut ids)?;
            }
            let mut job = job.clone().depends_on(after.iter().map(|a| ids[*a]));
            job.workflow_id = Some(id);
            run.push(job);
        }
        flush(conn, &mut run, &mut ids)?;
        let mut callbacks = [None, None, None];
        for (when, job) in workflow.callbacks() {
            let mut job = job.clone().depends_on(ids.iter().copied()).run_when(when);
            job.workflow_id = Some(id);
            let made = enqueue_many(conn, std::slice::from_ref(&job))?;
            let index = match when {
                RunWhen::AllCompleted => 0,
                RunWhen::AnyFailed => 1,
                RunWhen::AllFinished => 2,
            };
            callbacks[index] = made.first().map(|e| e.id);
        }
        let [on_success, on_failure, on_finish] = callbacks;
        dispatch!(conn, c => {
            diesel::update(tenure_workflows::table.find(id))
                .set((
                    tenure_workflows::on_success.eq(on_success),
                    tenure_workflows::on_failure.eq(on_failure),
                    tenure_workflows::on_finish.eq(on_finish),
                ))
                .execute(c)
        })?;
        Ok(EnqueuedWorkflow {
            id,
            jobs: ids,
            on_success,
            on_failure,
            on_finish,
        })
    })
}

fn flush<C: TenureConnection>(
    conn: &mut C,
    run: &mut Vec<NewJob>,
    ids: &mut Vec<i64>,
) -> Result<()> {
    if run.is_empty() {
        return Ok(());
    }
    let made: Vec<Enqueued> = enqueue_many(conn, run)?;
    ids.extend(made.iter().map(|e| e.id));
    run.clear();
    Ok(())
}

/// How many jobs are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCounts {
    /// Waiting for their dependencies.
    pub blocked: i64,
    /// Waiting to be claimed.
    pub waiting: i64,
    /// Running.
    pub running: i64,
    /// Parked until something outside answers them.
    pub parked: i64,
    /// Completed.
    pub completed: i64,
    /// Dead.
    pub dead: i64,
    /// Cancelled.
    pub cancelled: i64,
}

impl StateCounts {
    fn add(&mut self, state: JobState, n: i64) {
        let slot = match state {
            JobState::Blocked => &mut self.blocked,
            JobState::Waiting => &mut self.waiting,
            JobState::Running => &mut self.running,
            JobState::Parked => &mut self.parked,
            JobState::Completed => &mut self.completed,
            JobState::Dead => &mut self.dead,
            JobState::Cancelled => &mut self.cancelled,
        };
        *slot += n;
    }

    /// Jobs not yet finished.
    pub fn unfinished(&self) -> i64 {
        self.blocked + self.waiting + self.running + self.parked
    }
}

/// A workflow's (or batch's) state, from [`workflow_status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkflowStatus {
    /// Its id.
    pub id: i64,
    /// Its name.
    pub name: String,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// Its steps per state (callbacks not counted).
    pub counts: StateCounts,
    /// The success callback and its state.
    pub on_success: Option<(i64, JobState)>,
    /// The failure callback and its state.
    pub on_failure: Option<(i64, JobState)>,
    /// The finish callback and its state.
    pub on_finish: Option<(i64, JobState)>,
}

#[derive(QueryableByName)]
struct StateCount {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Counts per state, from the index on `(workflow_id, state)`.
const COUNTS: &str =
    "SELECT state, COUNT(*) AS n FROM tenure_jobs WHERE workflow_id = ? GROUP BY state";

/// A workflow's (or batch's) state in one call: its steps per state and its callbacks',
/// or `None` if there is no such workflow.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, JobState, NewJob, Workflow};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let mut batch = Workflow::new("mail-out");
/// batch.add(NewJob::new("mail", "send", vec![]));
/// batch.on_success(NewJob::new("mail", "report", vec![]));
/// let id = jobs::enqueue_workflow(&mut conn, &batch)?.id;
/// let send = jobs::claim(&mut conn, "mail", 1, Duration::from_secs(60))?.remove(0);
/// jobs::complete(&mut conn, &[send.claim()])?;
/// let status = jobs::workflow_status(&mut conn, id)?.unwrap();
/// assert_eq!(status.counts.completed, 1);
/// assert_eq!(status.on_success.unwrap().1, JobState::Waiting); // released
/// # Ok(()) }
/// ```
pub fn workflow_status<C: TenureConnection>(
    conn: &mut C,
    id: i64,
) -> Result<Option<WorkflowStatus>> {
    type Row = (String, DateTime<Utc>, Option<i64>, Option<i64>, Option<i64>);
    let found: Option<(Row, Vec<StateCount>, Vec<IdStateRow>)> = dispatch!(conn, c => {
        let row: Option<Row> = tenure_workflows::table
            .find(id)
            .select((
                tenure_workflows::name,
                tenure_workflows::created_at,
                tenure_workflows::on_success,
                tenure_workflows::on_failure,
                tenure_workflows::on_finish,
            ))
            .get_result(c)
            .optional()?;
        match row {
            None => Ok::<_, Error>(None),
            Some(row) => {
                let counts = statement(COUNTS).bind::<BigInt, _>(id).load::<StateCount>(c)?;
                let callbacks: Vec<i64> = [row.2, row.3, row.4].into_iter().flatten().collect();
                let states = if callbacks.is_empty() {
                    Vec::new()
                } else {
                    statement("SELECT id, state FROM tenure_jobs WHERE id IN {ids}")
                        .bind_ids(callbacks)
                        .load::<IdStateRow>(c)?
                };
                Ok(Some((row, counts, states)))
            }
        }
    })?;
    let Some(((name, created_at, on_success, on_failure, on_finish), counts, states)) = found
    else {
        return Ok(None);
    };
    let mut all = StateCounts::default();
    for row in counts {
        all.add(JobState::parse(&row.state)?, row.n);
    }
    let mut state_of = BTreeMap::new();
    for row in states {
        let state = JobState::parse(&row.state)?;
        all.add(state, -1);
        state_of.insert(row.id, state);
    }
    let with_state = |id: Option<i64>| id.and_then(|id| state_of.get(&id).map(|s| (id, *s)));
    Ok(Some(WorkflowStatus {
        id,
        name,
        created_at,
        counts: all,
        on_success: with_state(on_success),
        on_failure: with_state(on_failure),
        on_finish: with_state(on_finish),
    }))
}

/// A job of a workflow, from [`workflow_jobs`].
#[derive(Debug, Clone, PartialEq)]
pub struct WorkflowJob {
    /// Its id.
    pub id: i64,
    /// Its kind.
    pub kind: String,
    /// Its state.
    pub state: JobState,
    /// With dependencies: when it runs.
    pub run_when: Option<RunWhen>,
    /// Its progress while running, as last recorded.
    pub progress: Option<f64>,
    /// The jobs it depends on.
    pub dependencies: Vec<i64>,
}

/// The jobs of a workflow, by id, with their dependencies: its graph (the `tenure` command
/// draws it as a tree).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use tenure::jobs::{self, NewJob, Workflow};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let mut flow = Workflow::new("diamond");
/// let a = flow.add(NewJob::new("q", "a", vec![]));
/// let b = flow.add_after(&[a], NewJob::new("q", "b", vec![]));
/// let c = flow.add_after(&[a], NewJob::new("q", "c", vec![]));
/// flow.add_after(&[b, c], NewJob::new("q", "d", vec![]));
/// let made = jobs::enqueue_workflow(&mut conn, &flow)?;
/// let graph = jobs::workflow_jobs(&mut conn, made.id)?;
/// assert_eq!(graph[3].dependencies, vec![made.jobs[1], made.jobs[2]]);
/// # Ok(()) }
/// ```
pub fn workflow_jobs<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Vec<WorkflowJob>> {
    type Row = (i64, String, JobState, Option<RunWhen>, Option<f64>);
    let (rows, edges): (Vec<Row>, Vec<(i64, i64)>) = dispatch!(conn, c => {
        let rows: Vec<Row> = tenure_jobs::table
            .filter(tenure_jobs::workflow_id.eq(id))
            .select((tenure_jobs::id, tenure_jobs::kind, tenure_jobs::state, tenure_jobs::run_when, tenure_jobs::progress))
            .order(tenure_jobs::id)
            .load(c)?;
        let edges: Vec<(i64, i64)> = tenure_job_dependencies::table
            .inner_join(tenure_jobs::table.on(tenure_jobs::id.eq(tenure_job_dependencies::job_id)))
            .filter(tenure_jobs::workflow_id.eq(id))
            .select((tenure_job_dependencies::job_id, tenure_job_dependencies::depends_on))
            .order((tenure_job_dependencies::job_id, tenure_job_dependencies::depends_on))
            .load(c)?;
        Ok::<_, Error>((rows, edges))
    })?;
    let mut deps: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (job, on) in edges {
        deps.entry(job).or_default().push(on);
    }
    Ok(rows
        .into_iter()
        .map(|(id, kind, state, run_when, progress)| WorkflowJob {
            dependencies: deps.remove(&id).unwrap_or_default(),
            id,
            kind,
            state,
            run_when,
            progress,
        })
        .collect())
}

const UNFINISHED: &str = "SELECT id FROM tenure_jobs WHERE workflow_id = ? \
    AND state IN ('blocked', 'waiting', 'running', 'parked') ORDER BY id";

/// The workflow's unfinished jobs, locked in id order (the order every locker of job rows
/// keeps), and read as locked.
const LOCK_UNFINISHED: &str = "SELECT id, state, dependents AS n FROM tenure_jobs \
    WHERE id IN {ids} AND state IN ('blocked', 'waiting', 'running', 'parked') ORDER BY id{for_update}";

#[derive(QueryableByName)]
struct Unfinished {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    n: i32,
}

/// Cancels a whole workflow, in one transaction (the caller's, if open): every blocked or
/// waiting job of it is cancelled and every running one asked to cancel (it is cancelled
/// when its run ends, as with [`crate::jobs::cancel`]), so that nothing of it is left runnable;
/// then the jobs outside it that depend on its jobs follow their [`RunWhen`]. The jobs are
/// locked first, all in id order, and their dependents settled once at the end, so a
/// completion racing the cancel waits or goes first, never deadlocks with it. Returns how
/// many jobs it cancelled or asked to (0 for a workflow with nothing left to cancel, or no
/// such workflow).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob, Workflow};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let mut flow = Workflow::new("etl");
/// let fetch = flow.add(NewJob::new("etl", "fetch", vec![]));
/// flow.add_after(&[fetch], NewJob::new("etl", "merge", vec![]));
/// let id = jobs::enqueue_workflow(&mut conn, &flow)?.id;
/// assert_eq!(jobs::cancel_workflow(&mut conn, id)?, 2);
/// assert!(jobs::claim(&mut conn, "etl", 10, Duration::from_secs(60))?.is_empty());
/// # Ok(()) }
/// ```
pub fn cancel_workflow<C: TenureConnection>(conn: &mut C, id: i64) -> Result<usize> {
    let released = retrying_transaction(conn, |conn| {
        let ids: Vec<i64> = dispatch!(conn, c => {
            statement(UNFINISHED).bind::<BigInt, _>(id).load::<IdRow>(c)
        })?
        .into_iter()
        .map(|row| row.id)
        .collect();
        let mut locked: Vec<Unfinished> = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(crate::jobs::MAX_BATCH) {
            let rows: Vec<Unfinished> = dispatch!(conn, c => {
                statement(c.syntax().render(LOCK_UNFINISHED))
                    .bind_ids(chunk.iter().copied())
                    .load::<Unfinished>(c)
            })?;
            locked.extend(rows);
        }
        let mut cancelled = 0;
        let mut settle = Vec::new();
        for job in &locked {
            if crate::jobs::maintenance::admin::cancel_locked(conn, job.id)? {
                cancelled += 1;
                if job.state != "running" {
                    super::sequence_edges::splice_out_of_sequence(conn, job.id)?;
                }
                if job.state != "running" && job.n != 0 {
                    settle.push((job.id, JobState::Cancelled));
                }
            }
        }
        let released = crate::jobs::workflows::dependencies::settle(conn, settle)?;
        Ok::<_, Error>((cancelled, released))
    })?;
    let (cancelled, released) = released;
    crate::wake::wake(released.iter().map(String::as_str));
    if cancelled > 0 {
        crate::jobs::queue::wait::ended();
    }
    Ok(cancelled)
}

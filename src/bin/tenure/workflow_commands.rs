//! `tenure workflows`: list workflows (and batches), show one as a tree of its jobs with their
//! states, cancel one whole.

use std::collections::{BTreeMap, HashMap, HashSet};

use clap::Subcommand;
use diesel::prelude::*;
use serde_json::{Value, json};
use tenure::Pool;
use tenure::jobs::{self, JobState, StateCounts, WorkflowJob, WorkflowStatus};
use tenure::schema::tenure_workflows;

use crate::output::{Out, clean, progress, short, table};
use crate::{Failure, Outcome};

#[derive(Subcommand)]
pub enum WorkflowsCommand {
    /// Workflows and batches, newest first, with their steps per state.
    List {
        /// How many (1 to 1000).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
    },
    /// One workflow as a tree of its jobs, with their states.
    ///
    /// Its steps per state; its jobs as a tree, each under the first job it waits for (and
    /// named under the others), the first 200 lines of it; its callbacks. --json gives every
    /// job with its dependencies.
    Show { id: i64 },
    /// Cancel a whole workflow, callbacks included.
    ///
    /// Its blocked and waiting jobs are cancelled now, its running ones asked to stop (they
    /// are cancelled when their handlers return). Nothing left to cancel is not an error;
    /// no such workflow is exit code 1.
    Cancel { id: i64 },
}

/// The most lines of the tree: a workflow may have 10,000 jobs.
const MAX_TREE_LINES: usize = 200;
/// Deeper jobs are drawn at this depth, with their depth written out, so that a long chain
/// stays within 80 columns.
const MAX_DRAWN_DEPTH: usize = 10;
/// The width the tree's lines aim for.
const WIDTH: usize = 80;

pub fn run(
    open: impl FnOnce() -> Result<Pool, Failure>,
    command: WorkflowsCommand,
    out: &Out,
) -> Outcome {
    let pool = open()?;
    let mut conn = pool.get()?;
    match command {
        WorkflowsCommand::List { limit } => {
            let ids: Vec<i64> = tenure_workflows::table
                .select(tenure_workflows::id)
                .order(tenure_workflows::id.desc())
                .limit(i64::from(limit))
                .load(&mut *conn)
                .map_err(tenure::Error::from)?;
            let mut list = Vec::with_capacity(ids.len());
            for id in ids {
                // Gone meanwhile: left out.
                if let Some(status) = jobs::workflow_status(&mut conn, id)? {
                    list.push(status);
                }
            }
            let value = json!(list.iter().map(status_json).collect::<Vec<_>>());
            out.print(value, || {
                table(
                    &["id", "name", "created", "steps", "states"],
                    list.iter().map(|w| {
                        vec![
                            w.id.to_string(),
                            short(&clean(&w.name), 40),
                            w.created_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                            total(&w.counts).to_string(),
                            counts_text(&w.counts),
                        ]
                    }),
                )
            })
        }
        WorkflowsCommand::Show { id } => {
            let status = jobs::workflow_status(&mut conn, id)?
                .ok_or_else(|| Failure::new(1, format!("no workflow {id}")))?;
            let all = jobs::workflow_jobs(&mut conn, id)?;
            let mut value = status_json(&status);
            let callbacks = callbacks(&status);
            value["jobs"] = json!(
                all.iter()
                    .map(|j| {
                        let callback = callbacks.iter().find(|(_, cb)| *cb == j.id);
                        json!({"id": j.id, "kind": j.kind, "state": j.state.as_str(),
                               "run_when": j.run_when.map(|w| w.as_str()),
                               "progress": j.progress, "dependencies": j.dependencies,
                               "callback": callback.map(|(name, _)| name.replace(' ', "_"))})
                    })
                    .collect::<Vec<_>>()
            );
            out.print(value, || show_text(&status, &all))
        }
        WorkflowsCommand::Cancel { id } => {
            let status = jobs::workflow_status(&mut conn, id)?
                .ok_or_else(|| Failure::new(1, format!("no workflow {id}")))?;
            let cancelled = jobs::cancel_workflow(&mut conn, id)?;
            out.print(json!({"workflow": id, "cancelled": cancelled}), || {
                let name = short(&clean(&status.name), 40);
                match cancelled {
                    0 => format!("workflow {id} ({name}): nothing left to cancel"),
                    n => format!(
                        "workflow {id} ({name}): {n} job(s) cancelled or, if running, asked \
                         to stop (cancelled when their handlers return)"
                    ),
                }
            })
        }
    }
}

/// Steps (callbacks not counted).
fn total(c: &StateCounts) -> i64 {
    c.blocked + c.waiting + c.running + c.completed + c.dead + c.cancelled
}

fn by_state(c: &StateCounts) -> [(&'static str, i64); 6] {
    [
        ("completed", c.completed),
        ("running", c.running),
        ("waiting", c.waiting),
        ("blocked", c.blocked),
        ("dead", c.dead),
        ("cancelled", c.cancelled),
    ]
}

/// `3 completed, 1 running`: the states that have steps (`none left`: all pruned).
fn counts_text(c: &StateCounts) -> String {
    let parts: Vec<String> = by_state(c)
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(state, n)| format!("{n} {state}"))
        .collect();
    if parts.is_empty() {
        return "none left".to_string();
    }
    parts.join(", ")
}

/// The callbacks that exist: (when, id, state).
fn callback_states(s: &WorkflowStatus) -> Vec<(&'static str, i64, JobState)> {
    [
        ("on success", s.on_success),
        ("on failure", s.on_failure),
        ("on finish", s.on_finish),
    ]
    .into_iter()
    .filter_map(|(name, cb)| cb.map(|(id, state)| (name, id, state)))
    .collect()
}

fn callbacks(s: &WorkflowStatus) -> Vec<(&'static str, i64)> {
    callback_states(s)
        .into_iter()
        .map(|(name, id, _)| (name, id))
        .collect()
}

fn status_json(s: &WorkflowStatus) -> Value {
    let counts: serde_json::Map<String, Value> = by_state(&s.counts)
        .iter()
        .map(|(state, n)| (state.to_string(), json!(n)))
        .collect();
    let callback = |cb: Option<(i64, JobState)>| {
        cb.map(|(id, state)| json!({"id": id, "state": state.as_str()}))
    };
    json!({"id": s.id, "name": s.name, "created_at": s.created_at, "steps": total(&s.counts),
           "counts": counts, "on_success": callback(s.on_success),
           "on_failure": callback(s.on_failure), "on_finish": callback(s.on_finish)})
}

/// The header, the tree of steps and the callbacks.
fn show_text(status: &WorkflowStatus, all: &[WorkflowJob]) -> String {
    let callbacks = callback_states(status);
    let callback_ids: HashSet<i64> = callbacks.iter().map(|(_, id, _)| *id).collect();
    let steps: Vec<&WorkflowJob> = all
        .iter()
        .filter(|j| !callback_ids.contains(&j.id))
        .collect();
    let mut text = format!(
        "workflow {} \"{}\", created {}\n{} step(s): {}\n\n",
        status.id,
        short(&clean(&status.name), 40),
        status.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
        total(&status.counts),
        counts_text(&status.counts),
    );
    for line in Tree::new(&steps).lines(MAX_TREE_LINES) {
        text.push_str(&line);
        text.push('\n');
    }
    if !callbacks.is_empty() {
        text.push_str("\ncallbacks:\n");
        let kinds: HashMap<i64, &str> = all.iter().map(|j| (j.id, j.kind.as_str())).collect();
        for (name, id, state) in callbacks {
            let kind = kinds.get(&id).copied().unwrap_or("?");
            text.push_str(&format!(
                "  {name:<11} #{id} {} {}\n",
                short(&clean(kind), 40),
                state.as_str()
            ));
        }
    }
    text
}

/// A workflow's steps as a tree: roots (no dependency inside the workflow) at the top,
/// each job under its first (lowest-id) parent, and a one-line reference under the others.
struct Tree<'a> {
    jobs: BTreeMap<i64, &'a WorkflowJob>,
    children: HashMap<i64, Vec<i64>>,
    first_parent: HashMap<i64, i64>,
}

/// What the walk draws next.
enum Item {
    Job { id: i64, depth: usize, last: bool },
    Reference { id: i64, depth: usize, last: bool },
}

impl<'a> Tree<'a> {
    fn new(steps: &[&'a WorkflowJob]) -> Tree<'a> {
        let jobs: BTreeMap<i64, &WorkflowJob> = steps.iter().map(|j| (j.id, *j)).collect();
        let mut children: HashMap<i64, Vec<i64>> = HashMap::new();
        let mut first_parent = HashMap::new();
        for job in jobs.values() {
            let mut parents: Vec<i64> = job
                .dependencies
                .iter()
                .copied()
                .filter(|d| jobs.contains_key(d))
                .collect();
            parents.sort_unstable();
            if let Some(first) = parents.first() {
                first_parent.insert(job.id, *first);
            }
            for parent in parents {
                // Visited in id order: each list is sorted.
                children.entry(parent).or_default().push(job.id);
            }
        }
        Tree {
            jobs,
            children,
            first_parent,
        }
    }

    /// At most `max` lines, then one saying how many jobs were left out. A walk with its
    /// own stack: a chain of 10,000 jobs is 10,000 levels deep.
    fn lines(&self, max: usize) -> Vec<String> {
        let roots: Vec<i64> = self
            .jobs
            .keys()
            .copied()
            .filter(|id| !self.first_parent.contains_key(id))
            .collect();
        let mut stack: Vec<Item> = roots
            .iter()
            .rev()
            .map(|id| Item::Job {
                id: *id,
                depth: 0,
                last: false,
            })
            .collect();
        // Per depth of the path drawn: whether the job there was its parent's last child
        // (then no rule continues below it).
        let mut lasts: Vec<bool> = Vec::new();
        let mut drawn: HashSet<i64> = HashSet::new();
        let mut lines = Vec::new();
        while let Some(item) = stack.pop() {
            if lines.len() == max {
                let left = self.jobs.len() - drawn.len();
                lines.push(if left > 0 {
                    format!("… {left} more jobs (--json lists them all)")
                } else {
                    "… more lines (--json lists every job)".to_string()
                });
                break;
            }
            let (id, depth, last, reference) = match item {
                Item::Job { id, depth, last } => (id, depth, last, false),
                Item::Reference { id, depth, last } => (id, depth, last, true),
            };
            lasts.truncate(depth);
            lasts.push(last);
            let prefix = self.prefix(&lasts);
            let job = self.jobs[&id];
            let line = if reference {
                let whereabouts = if drawn.contains(&id) {
                    "see above".to_string()
                } else {
                    format!("see under #{}", self.first_parent[&id])
                };
                self.line(&prefix, job, &format!("({whereabouts})"), false)
            } else {
                self.line(&prefix, job, "", true)
            };
            lines.push(line);
            if reference {
                continue;
            }
            drawn.insert(id);
            let children = self.children.get(&id).map_or(&[][..], Vec::as_slice);
            for (i, child) in children.iter().enumerate().rev() {
                let last = i + 1 == children.len();
                let depth = depth + 1;
                stack.push(if self.first_parent[child] == id {
                    Item::Job {
                        id: *child,
                        depth,
                        last,
                    }
                } else {
                    Item::Reference {
                        id: *child,
                        depth,
                        last,
                    }
                });
            }
        }
        lines
    }

    /// The rules and branch before a job at depth `lasts.len() - 1`; past
    /// [`MAX_DRAWN_DEPTH`] the deeper levels are left out and the depth written instead.
    fn prefix(&self, lasts: &[bool]) -> String {
        let depth = lasts.len() - 1;
        if depth == 0 {
            return String::new();
        }
        let mut prefix = String::new();
        let shown = depth.min(MAX_DRAWN_DEPTH);
        for last in &lasts[1..shown] {
            prefix.push_str(if *last { "   " } else { "│  " });
        }
        prefix.push_str(if lasts[depth] { "└─ " } else { "├─ " });
        if depth > MAX_DRAWN_DEPTH {
            prefix.push_str(&format!("[depth {depth}] "));
        }
        prefix
    }

    /// `#id kind state 42% [all_completed] +2 outside`, the kind cut to fit 80 columns.
    fn line(&self, prefix: &str, job: &WorkflowJob, note: &str, full: bool) -> String {
        let mut tail = String::new();
        if full {
            tail.push(' ');
            tail.push_str(job.state.as_str());
            if let Some(p) = job.progress {
                tail.push(' ');
                tail.push_str(&progress(p));
            }
            if let Some(when) = job.run_when {
                tail.push_str(&format!(" [{}]", when.as_str()));
            }
            let outside = job
                .dependencies
                .iter()
                .filter(|d| !self.jobs.contains_key(d))
                .count();
            if outside > 0 {
                tail.push_str(&format!(" +{outside} outside"));
            }
        }
        if !note.is_empty() {
            tail.push(' ');
            tail.push_str(note);
        }
        let head = format!("{prefix}#{} ", job.id);
        let used = head.chars().count() + tail.chars().count();
        let room = WIDTH.saturating_sub(used).max(8);
        format!("{head}{}{tail}", short(&clean(&job.kind), room))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure::jobs::RunWhen;

    fn job(id: i64, deps: &[i64]) -> WorkflowJob {
        WorkflowJob {
            id,
            kind: format!("k{id}"),
            state: JobState::Blocked,
            run_when: (!deps.is_empty()).then_some(RunWhen::AllCompleted),
            progress: None,
            dependencies: deps.to_vec(),
        }
    }

    fn draw(jobs: &[WorkflowJob], max: usize) -> Vec<String> {
        let refs: Vec<&WorkflowJob> = jobs.iter().collect();
        Tree::new(&refs).lines(max)
    }

    #[test]
    fn a_diamond_is_drawn_once_with_a_reference() {
        let lines = draw(
            &[job(1, &[]), job(2, &[1]), job(3, &[1]), job(4, &[2, 3])],
            200,
        );
        assert_eq!(
            lines,
            [
                "#1 k1 blocked",
                "├─ #2 k2 blocked [all_completed]",
                "│  └─ #4 k4 blocked [all_completed]",
                "└─ #3 k3 blocked [all_completed]",
                "   └─ #4 k4 (see above)",
            ]
        );
    }

    #[test]
    fn a_reference_before_the_job_says_where_it_is() {
        // #4's first parent #3 hangs under root #2, drawn after root #1's subtree.
        let lines = draw(
            &[job(1, &[]), job(2, &[]), job(3, &[2]), job(4, &[1, 3])],
            200,
        );
        assert_eq!(lines[1], "└─ #4 k4 blocked [all_completed]");
        let lines = draw(
            &[
                job(1, &[]),
                job(2, &[]),
                job(3, &[2]),
                job(4, &[1]),
                job(5, &[3, 4]),
            ],
            200,
        );
        assert_eq!(lines[2], "   └─ #5 k5 (see under #3)");
        assert_eq!(lines[5], "   └─ #5 k5 blocked [all_completed]");
    }

    #[test]
    fn long_chains_and_wide_batches_are_bounded() {
        let chain: Vec<WorkflowJob> = (1..=10_000)
            .map(|i| {
                if i == 1 {
                    job(i, &[])
                } else {
                    job(i, &[i - 1])
                }
            })
            .collect();
        let lines = draw(&chain, 200);
        assert_eq!(lines.len(), 201);
        assert_eq!(lines[200], "… 9800 more jobs (--json lists them all)");
        assert!(
            lines.iter().all(|l| l.chars().count() <= WIDTH),
            "{lines:?}"
        );
        assert!(lines[150].contains("[depth 150] #151"), "{}", lines[150]);
    }
}

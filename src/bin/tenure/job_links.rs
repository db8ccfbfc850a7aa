//! What `tenure jobs show` adds for jobs of workflows and jobs with dependencies: the
//! workflow, the jobs it waits for and their states, its progress and its result.

use diesel::prelude::*;
use serde_json::{Value, json};
use tenure::jobs::{self, Job, JobResult, JobState};
use tenure::schema::{tenure_job_dependencies, tenure_jobs};
use tenure::{AnyConnection, Error};

use crate::Failure;
use crate::output::{clean, json_safe, progress};

/// How many dependencies the text names; `--json` gives them all.
const LISTED_DEPENDENCIES: usize = 20;
/// How much of a JSON result the text shows, in bytes; `--json` gives it all.
const SHOWN_RESULT_BYTES: usize = 2048;
/// How many leading bytes of a bytes result the text shows, in hex.
const SHOWN_HEX_BYTES: usize = 16;

/// A job's links, read once for the text and the JSON.
pub struct Links {
    /// The workflow's id and name.
    workflow: Option<(i64, String)>,
    /// The jobs it waits for (or waited for), by id, with their states.
    waits_for: Vec<(i64, JobState)>,
    result: Option<JobResult>,
}

impl Links {
    pub fn load(conn: &mut AnyConnection, job: &Job) -> Result<Links, Failure> {
        let workflow = match job.workflow_id {
            Some(id) => Some((
                id,
                jobs::workflow_status(conn, id)?.map_or_else(String::new, |w| w.name),
            )),
            None => None,
        };
        // Ids and states only: `jobs::dependency_results` would also read every
        // dependency's result (up to 1 MiB each), for a callback of a workflow of 10,000
        // jobs far more than a command that prints 20 states should read.
        let waits_for = tenure_job_dependencies::table
            .inner_join(
                tenure_jobs::table.on(tenure_jobs::id.eq(tenure_job_dependencies::depends_on)),
            )
            .filter(tenure_job_dependencies::job_id.eq(job.id))
            .select((tenure_jobs::id, tenure_jobs::state))
            .order(tenure_jobs::id)
            .load::<(i64, JobState)>(conn)
            .map_err(Error::from)?;
        let result = jobs::result(conn, job.id)?;
        Ok(Links {
            workflow,
            waits_for,
            result,
        })
    }

    /// A sequence's key, and what holds a blocked job of it: the job before it, or a dead
    /// or cancelled one that holds the rest until an operator acts.
    fn sequence(&self, job: &Job) -> Option<String> {
        let key = clean(job.sequence_key.as_deref()?);
        if job.state != JobState::Blocked {
            return Some(key);
        }
        Some(match self.waits_for.first() {
            Some((id, state @ (JobState::Dead | JobState::Cancelled))) => format!(
                "{key}, held by #{id} {}: `tenure jobs retry {id}` runs it again, \
                 `tenure jobs skip-in-sequence {id}` goes on without it",
                state.as_str()
            ),
            Some((id, state)) => format!("{key}, after #{id} ({})", state.as_str()),
            None => key,
        })
    }

    /// Fields for `jobs show`'s text, after the job's state; a field named "" continues
    /// the one before it.
    pub fn fields(&self, job: &Job) -> Vec<(&'static str, Option<String>)> {
        let mut fields = vec![
            (
                "workflow",
                self.workflow
                    .as_ref()
                    .map(|(id, name)| format!("{id} ({})", clean(name))),
            ),
            ("run when", job.run_when.map(|w| w.as_str().to_string())),
            ("sequence", self.sequence(job)),
        ];
        let mut entries: Vec<String> = self
            .waits_for
            .iter()
            .take(LISTED_DEPENDENCIES)
            .map(|(id, state)| format!("#{id} {}", state.as_str()))
            .collect();
        if self.waits_for.len() > LISTED_DEPENDENCIES {
            entries.push(format!(
                "and {} more",
                self.waits_for.len() - LISTED_DEPENDENCIES
            ));
        }
        // Wrapped to fit 80 columns after the 15 of the field names.
        let mut name = "waits for";
        let mut line = String::new();
        for (i, entry) in entries.iter().enumerate() {
            let entry = if i + 1 < entries.len() {
                format!("{entry},")
            } else {
                entry.clone()
            };
            if !line.is_empty() && line.len() + 1 + entry.len() > 64 {
                fields.push((name, Some(std::mem::take(&mut line))));
                name = "";
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(&entry);
        }
        if !line.is_empty() {
            fields.push((name, Some(line)));
        }
        fields.push((
            "progress",
            job.progress.map(|value| {
                let message = job.progress_message.as_deref().unwrap_or("");
                format!("{} {}", progress(value), clean(message))
                    .trim_end()
                    .to_string()
            }),
        ));
        fields
    }

    /// The result for `jobs show`'s text: pretty JSON cut to about 2 KB, or the length and
    /// first bytes of a bytes result.
    pub fn result_text(&self) -> Option<String> {
        let result = self.result.as_ref()?;
        let body = result.as_bytes();
        if !result.is_json() {
            let hex = to_hex(&body[..body.len().min(SHOWN_HEX_BYTES)]);
            let more = if body.len() > SHOWN_HEX_BYTES {
                "…"
            } else {
                ""
            };
            return Some(format!(
                "result: {} bytes, in hex {hex}{more}\n",
                body.len()
            ));
        }
        let pretty = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .map(json_safe)
            .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
        let mut text = format!("result (json, {} bytes):\n", body.len());
        if pretty.len() <= SHOWN_RESULT_BYTES {
            text.push_str(&pretty);
            text.push('\n');
        } else {
            let mut cut = SHOWN_RESULT_BYTES;
            while !pretty.is_char_boundary(cut) {
                cut -= 1;
            }
            text.push_str(&pretty[..cut]);
            text.push_str(&format!(
                "\n… (cut: the first {cut} of {} bytes as printed; --json gives it all)\n",
                pretty.len()
            ));
        }
        Some(text)
    }

    /// Adds the links to `jobs show --json`: the result whole, JSON as JSON and bytes in hex.
    pub fn add_json(&self, value: &mut Value) {
        value["workflow_name"] = json!(self.workflow.as_ref().map(|(_, name)| name));
        value["waits_for"] = json!(
            self.waits_for
                .iter()
                .map(|(id, state)| json!({"id": id, "state": state.as_str()}))
                .collect::<Vec<_>>()
        );
        value["result"] = match &self.result {
            None => Value::Null,
            Some(result) if result.is_json() => {
                match serde_json::from_slice::<Value>(result.as_bytes()) {
                    Ok(v) => json!({"format": "json", "value": v}),
                    // Not JSON after all (written by hand?): as text.
                    Err(_) => json!({"format": "json",
                                     "text": String::from_utf8_lossy(result.as_bytes())}),
                }
            }
            Some(result) => json!({"format": "bytes", "length": result.as_bytes().len(),
                                   "hex": to_hex(result.as_bytes())}),
        };
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

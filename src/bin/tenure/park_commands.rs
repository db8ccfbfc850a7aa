//! `tenure jobs complete-parked | fail-parked | resume-parked`: an operator answers a parked
//! job with its token, read from a file or stdin (never the command line, which other users
//! of the host see in `ps`).

use std::io::Read;
use std::path::PathBuf;

use clap::Args;
use serde_json::json;
use tenure::Pool;
use tenure::jobs::{self, JobResult, ParkToken, ParkedOutcome};

use crate::output::Out;
use crate::{Failure, Outcome};

/// Where the token comes from.
#[derive(Args)]
pub struct TokenSource {
    /// A file holding the token (`-` or none: standard input).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

/// The longest token text read (a token is about 85 bytes).
const MAX_TOKEN_TEXT: u64 = 1024;

impl TokenSource {
    /// Reads and parses the token; a malformed one is refused as a wrong one is (exit 8),
    /// its text never repeated.
    fn read(&self) -> Result<ParkToken, Failure> {
        let mut text = String::new();
        let read = match self.token_file.as_deref() {
            None => std::io::stdin()
                .take(MAX_TOKEN_TEXT)
                .read_to_string(&mut text),
            Some(path) if path.as_os_str() == "-" => std::io::stdin()
                .take(MAX_TOKEN_TEXT)
                .read_to_string(&mut text),
            Some(path) => std::fs::File::open(path)
                .and_then(|f| f.take(MAX_TOKEN_TEXT).read_to_string(&mut text)),
        };
        read.map_err(|e| Failure::new(2, format!("reading the token: {e}")))?;
        Ok(text.parse::<ParkToken>()?)
    }
}

/// A JSON value given on the command line, as a job's result or a resume's value.
fn json_value(flag: &str, text: Option<&str>) -> Result<Option<JobResult>, Failure> {
    let Some(text) = text else { return Ok(None) };
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Failure::new(2, format!("{flag}: not JSON: {e}")))?;
    Ok(Some(JobResult::json(&value)?))
}

/// What an answer says, for people and for scripts.
fn report(out: &Out, what: &str, id: i64, outcome: ParkedOutcome) -> Outcome {
    let applied = outcome == ParkedOutcome::Applied;
    out.print(
        json!({"job": id, "answer": what, "applied": applied}),
        || {
            if applied {
                format!("job {id}: {what}")
            } else {
                format!("job {id}: {what}, when the run that parked it returns")
            }
        },
    )
}

/// `complete-parked`.
pub fn complete(pool: &Pool, out: &Out, source: &TokenSource, result: Option<&str>) -> Outcome {
    let result = json_value("--result", result)?;
    let token = source.read()?;
    let outcome = jobs::complete_parked(&mut pool.get()?, &token, result.as_ref())?;
    report(out, "completed", token.job_id(), outcome)
}

/// `fail-parked`.
pub fn fail(pool: &Pool, out: &Out, source: &TokenSource, error: &str) -> Outcome {
    let token = source.read()?;
    let outcome = jobs::fail_parked(&mut pool.get()?, &token, error)?;
    report(out, "failed", token.job_id(), outcome)
}

/// `resume-parked`.
pub fn resume(pool: &Pool, out: &Out, source: &TokenSource, value: Option<&str>) -> Outcome {
    let value = json_value("--value", value)?;
    let token = source.read()?;
    let outcome = jobs::resume_parked(&mut pool.get()?, &token, value.as_ref())?;
    report(out, "resumed", token.job_id(), outcome)
}

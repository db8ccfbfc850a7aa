//! Parked jobs on `tenure serve`: the job page's form to answer one with its token (an
//! operator's action, under the dashboard's credentials and CSRF check), and the callback
//! endpoint an outside party answers with the token alone (`POST /callbacks/parked/...`).
//!
//! The callback checks no dashboard credentials and no CSRF token: the park token is its
//! credential. Every refusal of a token (malformed, wrong, used, its job no longer parked)
//! gets the same reply, and the token is never logged (the server logs a request's method
//! and path, and the token is in a header).

use maud::{Markup, html};
use serde_json::json;
use tenure::jobs::{self, JobResult, ParkRefusal, ParkToken, ParkedOutcome};
use tenure::{AnyConnection, Error};

use super::http::{Incoming, Reply, link};
use super::server::Request;
use super::{Dashboard, required};

/// The header a callback carries its token in.
pub const TOKEN_HEADER: &str = "Tenure-Park-Token";

/// Where callbacks go: `complete`, `fail` or `resume` follows.
pub const CALLBACKS: &str = "/callbacks/parked/";

/// What a token's holder asks.
#[derive(Clone, Copy)]
enum Asked {
    Complete,
    Fail,
    Resume,
}

impl Asked {
    fn parse(text: &str) -> Option<Asked> {
        match text {
            "complete" => Some(Asked::Complete),
            "fail" => Some(Asked::Fail),
            "resume" => Some(Asked::Resume),
            _ => None,
        }
    }
}

/// Answers a park: a JSON value (complete, resume) or an error text (fail).
fn answer(
    conn: &mut AnyConnection,
    token: &ParkToken,
    asked: Asked,
    value: Option<&JobResult>,
    error: &str,
) -> Result<ParkedOutcome, Error> {
    match asked {
        Asked::Complete => jobs::complete_parked(conn, token, value),
        Asked::Resume => jobs::resume_parked(conn, token, value),
        Asked::Fail => jobs::fail_parked(conn, token, error),
    }
}

/// A JSON value from text: none when empty.
fn json_value(text: &str) -> Result<Option<JobResult>, String> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("the value is not JSON: {e}"))?;
    JobResult::json(&value).map(Some).map_err(|e| e.to_string())
}

/// The job page's form, for a parked job: the token (a password field, never shown back),
/// a value, and what to do.
pub fn form(dashboard: &Dashboard, id: i64) -> Markup {
    if dashboard.read_only {
        return html! {};
    }
    html! {
        form.action.parked #park-answer method="post" action="/job/parked" {
            input type="hidden" name="csrf" value=(dashboard.access.csrf());
            input type="hidden" name="id" value=(id);
            label { "Token " input type="password" name="token" autocomplete="off" required; }
            " "
            label { "Value (JSON; the error to fail with) " input type="text" name="value"; }
            " "
            button type="submit" name="answer" value="complete" { "Complete" }
            button type="submit" name="answer" value="resume" { "Resume" }
            button type="submit" name="answer" value="fail" class="danger" { "Fail" }
        }
    }
}

/// `POST /job/parked` (an operator's form): then back to the job, saying what happened.
pub fn act(conn: &mut AnyConnection, incoming: &Incoming) -> Result<Reply, Error> {
    let id = required(incoming, "id")?
        .trim()
        .parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| super::invalid("id", "is not a job id"))?;
    let asked = Asked::parse(required(incoming, "answer")?)
        .ok_or_else(|| super::invalid("answer", "is not complete, fail or resume"))?;
    let text = incoming.field("value").unwrap_or("");
    let value = match asked {
        Asked::Fail => None,
        Asked::Complete | Asked::Resume => {
            json_value(text).map_err(|reason| super::invalid("value", reason))?
        }
    };
    let error = if text.is_empty() {
        "failed by an operator"
    } else {
        text
    };
    let token = required(incoming, "token")?.parse::<ParkToken>();
    let done = match token {
        Ok(token) if token.job_id() == id => {
            match answer(conn, &token, asked, value.as_ref(), error) {
                Ok(ParkedOutcome::Applied) => "park-applied",
                Ok(ParkedOutcome::Accepted) => "park-accepted",
                Err(Error::ParkTokenRefused(ParkRefusal::Used)) => "park-used",
                Err(Error::ParkTokenRefused(ParkRefusal::NotParked)) => "park-not-parked",
                Err(Error::ParkTokenRefused(_)) => "park-refused",
                Err(e) => return Err(e),
            }
        }
        _ => "park-refused",
    };
    Ok(Reply::see_other(link(
        "/job",
        &[("id", &id.to_string()), ("done", done)],
    )))
}

/// What the job page says after the form.
pub fn notice(done: &str) -> Option<&'static str> {
    Some(match done {
        "park-applied" => "Answered: the job is no longer parked.",
        "park-accepted" => "Answered: applied when the run that parked it returns.",
        "park-used" => "Refused: that token was used already.",
        "park-not-parked" => "Refused: the job is no longer parked.",
        "park-refused" => "Refused: not this job's token.",
        _ => return None,
    })
}

/// `POST /callbacks/parked/{complete,fail,resume}`, the token in the `Tenure-Park-Token`
/// header; the body a JSON value (complete, resume; may be empty) or the error text (fail).
/// 200 with `{"job": id, "applied": bool}`; 403 for any refused token, whatever the reason;
/// 400 for a body that is not what the answer takes (checked before the token, so the reply
/// says nothing about it).
pub fn callback(dashboard: &Dashboard, request: &Request) -> Reply {
    if dashboard.read_only {
        return Reply::text(403, "read-only: callbacks are refused");
    }
    if request.method != "POST" {
        return Reply::text(405, "a callback is a POST");
    }
    let path = request.target.split('?').next().unwrap_or("");
    let Some(asked) = path.strip_prefix(CALLBACKS).and_then(Asked::parse) else {
        return Reply::text(404, "no such callback: complete, fail or resume");
    };
    let Ok(body) = std::str::from_utf8(&request.body) else {
        return Reply::text(400, "the body is not UTF-8");
    };
    let value = match asked {
        Asked::Fail => None,
        Asked::Complete | Asked::Resume => match json_value(body) {
            Ok(value) => value,
            Err(reason) => return Reply::text(400, &reason),
        },
    };
    let error = if body.trim().is_empty() {
        "failed by a callback"
    } else {
        body
    };
    let refused = || Reply::text(403, "the token was refused");
    let Some(Ok(token)) = request.header(TOKEN_HEADER).map(str::parse::<ParkToken>) else {
        return refused();
    };
    let mut conn = match dashboard.pool.get() {
        Ok(conn) => conn,
        Err(_) => return Reply::text(503, "the database is not reachable: try again"),
    };
    match answer(&mut conn, &token, asked, value.as_ref(), error) {
        Ok(outcome) => {
            let body = json!({"job": token.job_id(), "applied": outcome == ParkedOutcome::Applied});
            Reply {
                status: 200,
                content_type: "application/json",
                body: body.to_string().into_bytes(),
                headers: Vec::new(),
            }
        }
        Err(Error::ParkTokenRefused(_)) => refused(),
        Err(e) => {
            tracing::warn!(target: "tenure::serve", "a park callback failed: {e}");
            Reply::text(500, "database error: try again")
        }
    }
}

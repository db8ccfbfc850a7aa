//! The jobs: a filtered list paged by id (no OFFSET), one job's page, and the job actions
//! (retry a dead job, cancel a live one).

use diesel::prelude::*;
use maud::{Markup, html};
use tenure::jobs::{self, Job, JobState};
use tenure::schema::tenure_jobs;
use tenure::{AnyConnection, Error};

use super::http::{Incoming, Reply, link};
use super::layout::{Section, action, instant, maybe_instant, page, state_badge, thousands};
use super::{Dashboard, invalid, required};

/// Jobs per page.
const PAGE: i64 = 50;
/// The most ids one page looks through: a page costs the same whatever the table's size or
/// how rare the filter's matches are. A page that finds fewer than `PAGE` offers to look
/// further down.
const WINDOW: i64 = 100_000;
/// The most payload or output bytes a page shows.
const SHOWN_BYTES: usize = 64 * 1024;

pub const STATES: [JobState; 7] = [
    JobState::Blocked,
    JobState::Waiting,
    JobState::Running,
    JobState::Parked,
    JobState::Completed,
    JobState::Dead,
    JobState::Cancelled,
];

fn parse_state(text: &str) -> Result<JobState, Error> {
    STATES
        .into_iter()
        .find(|state| state.as_str() == text)
        .ok_or_else(|| invalid("state", format!("{text:?} is not a job state")))
}

fn parse_id(text: &str, field: &'static str) -> Result<i64, Error> {
    text.trim()
        .parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| invalid(field, format!("{text:?} is not a job id")))
}

/// `text` inside a LIKE pattern, its wildcards taken literally (escape character `!`).
fn contains_pattern(text: &str) -> String {
    let mut pattern = String::from("%");
    for c in text.chars() {
        if matches!(c, '%' | '_' | '!') {
            pattern.push('!');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}

/// `GET /jobs?queue=&kind=&state=&text=&before=`: newest first, `PAGE` at a time, within
/// `WINDOW` ids below `before`: a descending range of the primary key, filtered.
pub fn list(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    incoming: &Incoming,
) -> Result<Reply, Error> {
    let queue = incoming.field("queue");
    let kind = incoming.field("kind");
    let text = incoming.field("text");
    let state = incoming.field("state").map(parse_state).transpose()?;
    let before = incoming
        .field("before")
        .map(|b| parse_id(b, "before"))
        .transpose()?;
    for (field, value) in [("queue", queue), ("kind", kind), ("text", text)] {
        if value.is_some_and(|v| v.len() > tenure::MAX_NAME_BYTES) {
            return Err(invalid(
                field,
                format!("longer than {} bytes", tenure::MAX_NAME_BYTES),
            ));
        }
        // No stored name holds one, and PostgreSQL refuses it in text.
        if value.is_some_and(|v| v.contains('\0')) {
            return Err(invalid(field, "must not contain a NUL character"));
        }
    }
    // Past the newest job, a page would find nothing and offer to look further: start at
    // the newest instead.
    let newest: Option<i64> = tenure_jobs::table
        .select(diesel::dsl::max(tenure_jobs::id))
        .first(conn)?;
    let past_newest = newest.unwrap_or(0).saturating_add(1);
    let top = before.map_or(past_newest, |before| before.min(past_newest));
    let floor = top.saturating_sub(WINDOW).max(0);
    let mut query = tenure_jobs::table
        .select(Job::as_select())
        .filter(tenure_jobs::id.lt(top))
        .filter(tenure_jobs::id.ge(floor))
        .into_boxed();
    if let Some(queue) = queue {
        query = query.filter(tenure_jobs::queue.eq(queue));
    }
    if let Some(kind) = kind {
        query = query.filter(tenure_jobs::kind.eq(kind));
    }
    if let Some(state) = state {
        query = query.filter(tenure_jobs::state.eq(state));
    }
    if let Some(text) = text {
        let pattern = contains_pattern(text);
        query = query.filter(
            tenure_jobs::kind
                .like(pattern.clone())
                .escape('!')
                .nullable()
                .or(tenure_jobs::dedup_key.like(pattern.clone()).escape('!'))
                .or(tenure_jobs::last_error.like(pattern).escape('!')),
        );
    }
    let found: Vec<Job> = query.order(tenure_jobs::id.desc()).limit(PAGE).load(conn)?;
    let now = tenure::database_now(conn)?;
    let lowest: Option<i64> = tenure_jobs::table
        .select(diesel::dsl::min(tenure_jobs::id))
        .first(conn)?;
    // Where the next page starts: after the last job shown, or, on a page the window cut
    // short, below the window (if any job is there).
    let next = if found.len() as i64 == PAGE {
        found.last().map(|job| job.id)
    } else {
        lowest.filter(|lowest| *lowest < floor).map(|_| floor)
    };
    let state_text = state.map_or("", |s| s.as_str());
    let filters = [
        ("queue", queue.unwrap_or("")),
        ("kind", kind.unwrap_or("")),
        ("state", state_text),
        ("text", text.unwrap_or("")),
    ];
    let content = html! {
        form.filters method="get" action="/jobs" {
            label { "Queue" input name="queue" value=[queue]; }
            label { "Kind" input name="kind" value=[kind]; }
            label { "State"
                select name="state" {
                    option value="" { "any" }
                    @for s in STATES {
                        option value=(s.as_str()) selected[state == Some(s)] { (s.as_str()) }
                    }
                }
            }
            label { "Text (kind, dedup key, last error)" input name="text" value=[text]; }
            button type="submit" { "Filter" }
        }
        @if found.is_empty() {
            p.muted #no-jobs { "No job matches among ids " (floor) " to " (top - 1) "." }
        } @else {
            table #jobs {
                thead { tr {
                    th.num { "Id" } th { "Queue" } th { "Kind" } th { "State" } th.num { "Attempt" }
                    th { "Due" } th { "Finished" } th { "Last error" }
                } }
                tbody {
                    @for job in &found {
                        tr data-id=(job.id) {
                            td.num { a href=(link("/job", &[("id", &job.id.to_string())])) { (job.id) } }
                            td { (job.queue) }
                            td { (job.kind) }
                            td { (state_badge(job.state.as_str())) }
                            td.num { (job.attempt) "/" (job.max_attempts) }
                            td { (instant(job.due_at, now)) }
                            td { (maybe_instant(job.finished_at, now)) }
                            td.error-text { @if let Some(error) = &job.last_error { (first_line(error)) } }
                        }
                    }
                }
            }
        }
        div.pager {
            @if before.is_some() {
                a href=(link("/jobs", &filters)) { "Newest" }
            }
            @if let Some(next) = next {
                @let next = next.to_string();
                @let fields = [filters.as_slice(), &[("before", next.as_str())]].concat();
                a #older href=(link("/jobs", &fields)) { "Older" }
                @if (found.len() as i64) < PAGE {
                    span.muted { "This page looked through " (thousands(WINDOW as u64)) " ids; older ones may match." }
                }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(dashboard, Section::Jobs, "Jobs", None, content),
    ))
}

fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() > 160 {
        format!("{}…", line.chars().take(160).collect::<String>())
    } else {
        line.to_string()
    }
}

/// Bytes for people: pretty JSON, else text, else a hex dump; at most `SHOWN_BYTES`.
fn shown_bytes(bytes: &[u8]) -> Markup {
    let cut = &bytes[..bytes.len().min(SHOWN_BYTES)];
    // A cut may split a character: the text is what comes before it.
    let cut_text = match std::str::from_utf8(cut) {
        Ok(text) => Some(text),
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&cut[..e.valid_up_to()]).ok(),
        Err(_) => None,
    };
    let pretty = (bytes.len() <= SHOWN_BYTES)
        .then(|| serde_json::from_slice::<serde_json::Value>(bytes).ok())
        .flatten();
    let text = if let Some(value) = pretty {
        serde_json::to_string_pretty(&value).unwrap_or_default()
    } else if let Some(text) = cut_text.filter(|text| {
        !text
            .chars()
            .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
    }) {
        // Text without control characters (a NUL or an escape is shown as bytes).
        text.to_string()
    } else {
        cut.chunks(16)
            .enumerate()
            .map(|(i, row)| {
                let hex: Vec<String> = row.iter().map(|b| format!("{b:02x}")).collect();
                format!("{:08x}  {}", i * 16, hex.join(" "))
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    html! {
        pre { (text) }
        @if bytes.len() > SHOWN_BYTES {
            p.muted { "The first " (thousands(SHOWN_BYTES as u64)) " of " (thousands(bytes.len() as u64)) " bytes." }
        }
    }
}

/// `GET /job?id=N`: one job, its completed steps, failed runs, outputs, result and limits.
pub fn job_page(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    incoming: &Incoming,
    notice: Option<&str>,
) -> Result<Reply, Error> {
    let id = parse_id(required(incoming, "id")?, "id")?;
    let Some(job) = jobs::get(conn, id)? else {
        let content = html! { p #missing { "No job " (id) " (never enqueued, or pruned)." } };
        return Ok(Reply::html(
            404,
            page(
                dashboard,
                Section::Jobs,
                &format!("Job {id}"),
                None,
                content,
            ),
        ));
    };
    let now = tenure::database_now(conn)?;
    let history = jobs::history(conn, id)?;
    let outputs = jobs::outputs(conn, id)?;
    let result = jobs::result(conn, id)?;
    let steps = jobs::steps(conn, id)?;
    let park = jobs::park_record(conn, id)?;
    let limits = jobs::limits_of(conn, id)?;
    let sequence = sequence_of(conn, &job)?;
    let id_text = id.to_string();
    let live = matches!(
        job.state,
        JobState::Blocked | JobState::Waiting | JobState::Running | JobState::Parked
    );
    let content = html! {
        div.actions {
            (state_badge(job.state.as_str())) " "
            @if job.state == JobState::Dead {
                (action(dashboard, "/job/retry", &[("id", &id_text)], "Retry", false))
            }
            @if sequence.holds_back {
                (action(dashboard, "/job/skip-in-sequence", &[("id", &id_text)], "Let the sequence go on", true))
            }
            @if live && job.cancel_requested_at.is_none() {
                (action(dashboard, "/job/cancel", &[("id", &id_text)], "Cancel", true))
            }
            @if job.cancel_requested_at.is_some() && !job.state.is_final() {
                span.muted { "Cancel asked: it stops when its run ends." }
            }
        }
        @if job.state == JobState::Parked {
            p.muted { "Parked: it waits for an answer by its token (the callback, or this form)." }
            (super::parked::form(dashboard, id))
        }
        dl.fields #job-fields {
            dt { "Queue" } dd { a href=(link("/queue", &[("name", &job.queue)])) { (job.queue) } }
            dt { "Kind" } dd { (job.kind) }
            dt { "Attempt" } dd { (job.attempt) " of " (job.max_attempts)
                @if job.lapses > 0 { " · " (job.lapses) " lapsed claim(s)" }
                @if job.snoozes > 0 { " · snoozed " (job.snoozes) " time(s)" } }
            dt { "Priority" } dd { (job.priority) }
            dt { "Created" } dd { (instant(job.created_at, now)) }
            dt { "Due" } dd { (instant(job.due_at, now)) }
            dt { "Claimed" } dd { (maybe_instant(job.claimed_at, now)) }
            dt { "Claim expires" } dd { (maybe_instant(job.claim_expires_at, now)) }
            dt { "Finished" } dd { (maybe_instant(job.finished_at, now)) }
            @if let (Some(start), Some(end)) = (job.claimed_at, job.finished_at) {
                dt { "Last run took" } dd { ((end - start).num_milliseconds()) " ms" }
            }
            @if let Some(key) = &job.dedup_key {
                dt { "Dedup key" } dd { (key) " (" (job.dedup_hits) " enqueue(s) folded in)" }
            }
            @if let Some(workflow) = job.workflow_id { dt { "Workflow" } dd { (workflow) } }
            @if let Some(key) = &job.sequence_key {
                dt { "Sequence" } dd #sequence { (key)
                    @if let Some((before, state)) = sequence.waits_for {
                        @if matches!(state, JobState::Dead | JobState::Cancelled) {
                            " · held by " a href=(link("/job", &[("id", &before.to_string())])) { "#" (before) }
                            " (" (state.as_str()) "): retry it, or let the sequence go on from its page"
                        } @else {
                            " · after " a href=(link("/job", &[("id", &before.to_string())])) { "#" (before) }
                            " (" (state.as_str()) ")"
                        }
                    }
                    @if sequence.holds_back { " · holds the rest of its sequence back" }
                }
            }
            @if let Some(park) = &park {
                dt { "Parked" } dd { (instant(park.parked_at, now)) }
                dt { "Park deadline" } dd { (instant(park.deadline, now)) }
                dt { "Park answer" } dd {
                    @match (&park.answer, park.answered_at) {
                        (Some(answer), Some(when)) => { (answer) " · " (instant(when, now)) }
                        _ => { "none yet" }
                    }
                }
            }
            @if let Some(progress) = job.progress {
                dt { "Progress" } dd { (format!("{:.0}%", progress * 100.0))
                    @if let Some(message) = &job.progress_message { " · " (message) } }
            }
            @for limit in &limits {
                dt { "Limit" } dd { (limit.key())
                    @if let Some(max) = limit.max_running() { " · at most " (max) " running" }
                    @if let Some(rate) = limit.rate_cap() { " · " (format!("{rate:?}")) } }
            }
        }
        h2 { "Payload (" (thousands(job.payload.len() as u64)) " bytes)" }
        // A shell job's environment values are masked here, also to an operator.
        div #payload { (shown_bytes(&crate::work::shown_payload(&job.kind, &job.payload))) }
        @if let Some(result) = &result {
            h2 { "Result" }
            div #result { (shown_bytes(result.as_bytes())) }
        }
        @if !steps.is_empty() {
            h2 { "Steps" }
            table #steps {
                thead { tr { th { "Step" } th { "Done" } th.num { "Bytes" } th { "Result" } } }
                tbody {
                    @for step in &steps {
                        tr { td { (step.name) } td { (instant(step.created_at, now)) }
                            td.num { (thousands(step.result.len() as u64)) }
                            td { code { (first_line(&String::from_utf8_lossy(&step.result))) } } }
                    }
                }
            }
        }
        h2 { "Failed runs" }
        @if history.is_empty() {
            p.muted { "None." }
        } @else {
            table #errors {
                thead { tr { th.num { "Attempt" } th { "When" } th { "Error" } } }
                tbody {
                    @for run in &history {
                        tr { td.num { (run.attempt) } td { (instant(run.failed_at, now)) } td { pre { (run.error) } } }
                    }
                }
            }
        }
        @if !outputs.is_empty() {
            h2 { "Outputs" }
            @for output in &outputs {
                h3 { "Run " (output.attempt)
                    @if let Some(code) = output.exit_code { " · exit " (code) } " · " (instant(output.finished_at, now)) }
                (shown_bytes(&output.output))
            }
        }
    };
    Ok(Reply::html(
        200,
        page(
            dashboard,
            Section::Jobs,
            &format!("Job {id}"),
            notice,
            content,
        ),
    ))
}

/// Where a job of a sequence stands: the job it waits for (blocked), and whether, dead or
/// cancelled, it holds the rest of its sequence back.
struct SequencePlace {
    waits_for: Option<(i64, JobState)>,
    holds_back: bool,
}

fn sequence_of(conn: &mut AnyConnection, job: &Job) -> Result<SequencePlace, Error> {
    use tenure::schema::tenure_job_dependencies as deps;
    let mut place = SequencePlace {
        waits_for: None,
        holds_back: false,
    };
    if job.sequence_key.is_none() {
        return Ok(place);
    }
    if job.state == JobState::Blocked {
        place.waits_for = deps::table
            .inner_join(tenure_jobs::table.on(tenure_jobs::id.eq(deps::depends_on)))
            .filter(deps::job_id.eq(job.id))
            .select((tenure_jobs::id, tenure_jobs::state))
            .first::<(i64, JobState)>(conn)
            .optional()?;
    }
    if matches!(job.state, JobState::Dead | JobState::Cancelled) {
        let held: i64 = deps::table
            .filter(deps::depends_on.eq(job.id))
            .filter(deps::run_when.eq("sequence_hold"))
            .filter(deps::counted.eq(0))
            .count()
            .get_result(conn)?;
        place.holds_back = held > 0;
    }
    Ok(place)
}

/// `POST /job/retry`, `/job/cancel`, `/job/skip-in-sequence`: then back to the job.
pub fn act(conn: &mut AnyConnection, incoming: &Incoming) -> Result<Reply, Error> {
    let id = parse_id(required(incoming, "id")?, "id")?;
    let done = if incoming.path == "/job/skip-in-sequence" {
        if jobs::skip_in_sequence(conn, id)? > 0 {
            "sequence-goes-on"
        } else {
            "not-holding"
        }
    } else if incoming.path == "/job/retry" {
        if jobs::retry_dead(conn, id)? {
            "retried-one"
        } else {
            "not-dead"
        }
    } else if jobs::cancel(conn, id)? {
        "cancelled"
    } else {
        "not-live"
    };
    Ok(Reply::see_other(link(
        "/job",
        &[("id", &id.to_string()), ("done", done)],
    )))
}

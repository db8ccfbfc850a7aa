//! The queues: every queue's jobs per state, limits and their saturation (the front page),
//! one queue's finishes per minute, and the queue actions (pause, resume, retry the dead of
//! a kind).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use maud::{Markup, html};
use tenure::jobs::{self, JobState, QueueCounts};
use tenure::schema::{tenure_jobs, tenure_queue_limits, tenure_queue_pauses};
use tenure::sql_types::InstantValue;
use tenure::{AnyConnection, Error};

use super::http::{Incoming, Reply, link};
use super::layout::{Section, action, bounded, page, thousands};
use super::{Dashboard, required};

/// The most queues the front page lists (one index seek each).
const MAX_QUEUES: usize = 200;
/// Counts stop here: the front page costs the same with a thousand jobs or ten million.
const COUNT_BOUND: u32 = 10_000;
/// What the front page's counts of one state may add up to over all queues: with many
/// queues, each is counted to less (at least `MIN_BOUND`), so the page's cost stays put.
const COUNT_BUDGET: u32 = 40_000;
const MIN_BOUND: u32 = 200;
/// The chart's minutes.
const CHART_MINUTES: i64 = 30;
/// The most finishes the chart reads per state (the newest).
const CHART_BOUND: i64 = 20_000;
/// The dead jobs read for the kinds offered to retry.
const DEAD_SAMPLE: i64 = 1_000;

/// Queue names: a skip over the `(queue, ...)` index of `tenure_jobs`, one seek per queue
/// (no backend skips by itself: `SELECT DISTINCT` would read every job), and the queues
/// that are paused or limited with no jobs.
fn queue_names(conn: &mut AnyConnection) -> QueryResult<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    let mut last: Option<String> = None;
    while names.len() < MAX_QUEUES {
        let mut next = tenure_jobs::table
            .select(tenure_jobs::queue)
            .order(tenure_jobs::queue)
            .into_boxed();
        if let Some(last) = last {
            next = next.filter(tenure_jobs::queue.gt(last));
        }
        match next.first::<String>(conn).optional()? {
            Some(queue) => {
                names.insert(queue.clone());
                last = Some(queue);
            }
            None => break,
        }
    }
    names.extend(
        tenure_queue_pauses::table
            .select(tenure_queue_pauses::queue)
            .load::<String>(conn)?,
    );
    names.extend(
        tenure_queue_limits::table
            .select(tenure_queue_limits::queue)
            .load::<String>(conn)?,
    );
    Ok(names)
}

fn paused_queues(conn: &mut AnyConnection) -> QueryResult<BTreeSet<String>> {
    Ok(tenure_queue_pauses::table
        .select(tenure_queue_pauses::queue)
        .load::<String>(conn)?
        .into_iter()
        .collect())
}

/// A link to the jobs of `queue` in `state`, showing the bounded count.
fn count_link(queue: &str, state: JobState, count: u64, bound: u32) -> Markup {
    html! {
        a href=(link("/jobs", &[("queue", queue), ("state", state.as_str())])) {
            (bounded(count, bound))
        }
    }
}

/// A saturation meter: `used` of `max` (SVG, since the page's policy allows no inline style).
fn meter(used: u64, max: u64) -> Markup {
    let width = (used.min(max) * 60)
        .checked_div(max)
        .map_or(60, |w| w as u32);
    let full = used >= max;
    html! {
        svg.meter width="60" height="8" role="img" aria-label={ (used) " of " (max) } {
            rect width="60" height="8" rx="4" fill="#eef0f3" {}
            rect width=(width) height="8" rx="4" fill=(if full { "#d6454b" } else { "#3553d6" }) {}
        }
    }
}

/// `GET /`: every queue.
pub fn overview(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    notice: Option<&str>,
) -> Result<Reply, Error> {
    let names = queue_names(conn)?;
    let paused = paused_queues(conn)?;
    let limits: BTreeMap<String, u32> = jobs::queue_limits(conn)?.into_iter().collect();
    let bound = u32::try_from(names.len().max(1)).map_or(MIN_BOUND, |queues| {
        (COUNT_BUDGET / queues).clamp(MIN_BOUND, COUNT_BOUND)
    });
    let mut rows = Vec::new();
    for name in &names {
        rows.push((name, jobs::queue_counts(conn, name, bound)?));
    }
    let keys = jobs::key_states(conn, 50)?;
    let content = html! {
        @if rows.is_empty() {
            p.muted { "No queues yet: enqueue a job and it shows here." }
        } @else {
            table #queues {
                thead { tr {
                    th { "Queue" } th { "" }
                    th.num { "Blocked" } th.num { "Waiting" } th.num { "Due" } th.num { "Running" }
                    th.num { "Parked" } th.num { "Completed" } th.num { "Dead" } th.num { "Cancelled" } th { "Queue limit" }
                } }
                tbody {
                    @for (name, counts) in &rows {
                        tr data-queue=(name) {
                            td { a href=(link("/queue", &[("name", name)])) { (name) } }
                            td { @if paused.contains(*name) { span.state.paused { "paused" } } }
                            td.num { (count_link(name, JobState::Blocked, counts.blocked, bound)) }
                            td.num { (count_link(name, JobState::Waiting, counts.waiting, bound)) }
                            td.num { (bounded(counts.due, bound)) }
                            td.num { (count_link(name, JobState::Running, counts.running, bound)) }
                            td.num { (count_link(name, JobState::Parked, counts.parked, bound)) }
                            td.num { (count_link(name, JobState::Completed, counts.completed, bound)) }
                            td.num { (count_link(name, JobState::Dead, counts.dead, bound)) }
                            td.num { (count_link(name, JobState::Cancelled, counts.cancelled, bound)) }
                            td {
                                @if let Some(max) = limits.get(*name) {
                                    (meter(counts.running, u64::from(*max))) " "
                                    (bounded(counts.running, bound)) " / " (max)
                                } @else { span.muted { "none" } }
                            }
                        }
                    }
                }
            }
            p.muted { "Counts stop at " (thousands(u64::from(bound))) " (shown as "
                (thousands(u64::from(bound))) "+), so this page costs the same on any table size." }
        }
        h2 { "Limit keys" }
        @if keys.is_empty() {
            p.muted { "No limit key has running or throttled jobs." }
        } @else {
            table #limit-keys {
                thead { tr { th { "Key" } th.num { "Running" } th { "Concurrency" } th { "Throttled until" } } }
                tbody {
                    @for key in &keys {
                        tr {
                            td { (key.key) }
                            td.num { (key.running) }
                            td {
                                @if let Some(max) = key.max_running {
                                    (meter(key.running.max(0) as u64, max.max(0) as u64)) " " (key.running) " / " (max)
                                    @if key.saturated() { " " span.state.dead { "saturated" } }
                                } @else { span.muted { "none" } }
                            }
                            td { @if let Some(until) = key.throttled_until { (until.format("%H:%M:%S%.3f")) } @else { "–" } }
                        }
                    }
                }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(dashboard, Section::Queues, "Queues", notice, content),
    ))
}

/// The instants of `queue`'s latest finishes in `state` since `since`, newest first, at
/// most `CHART_BOUND`: a range of the `(queue, state, finished_at, id)` index. `state` is
/// completed, dead or cancelled (the index's states).
fn finishes(
    conn: &mut AnyConnection,
    queue: &str,
    state: JobState,
    since: DateTime<Utc>,
) -> QueryResult<Vec<DateTime<Utc>>> {
    Ok(tenure_jobs::table
        .filter(tenure_jobs::queue.eq(queue))
        .filter(tenure_jobs::state.eq(state))
        // The index's own condition, word for word: it is partial, and a planner uses a
        // partial index only when the statement's text implies its condition (SQLite: when
        // it holds the same term; PostgreSQL's generic plan: not from a bound state).
        .filter(diesel::dsl::sql::<diesel::sql_types::Bool>(
            "state IN ('completed', 'dead', 'cancelled')",
        ))
        .filter(tenure_jobs::finished_at.ge(InstantValue(since)))
        .select(tenure_jobs::finished_at)
        .order(tenure_jobs::finished_at.desc())
        .limit(CHART_BOUND)
        .load::<Option<DateTime<Utc>>>(conn)?
        .into_iter()
        .flatten()
        .collect())
}

/// Finishes per minute over the last `CHART_MINUTES`, as stacked bars.
fn chart(completed: &[DateTime<Utc>], dead: &[DateTime<Utc>], now: DateTime<Utc>) -> Markup {
    let minutes = CHART_MINUTES as usize;
    let bucket = |at: &DateTime<Utc>| {
        let age = (now - *at).num_seconds().max(0) as usize / 60;
        (age < minutes).then(|| minutes - 1 - age)
    };
    let mut ok = vec![0u64; minutes];
    let mut bad = vec![0u64; minutes];
    completed.iter().filter_map(bucket).for_each(|i| ok[i] += 1);
    dead.iter().filter_map(bucket).for_each(|i| bad[i] += 1);
    let top = (0..minutes)
        .map(|i| ok[i] + bad[i])
        .max()
        .unwrap_or(0)
        .max(1);
    let (width, height, bar) = (620u64, 120u64, 20u64);
    let scale = |n: u64| n * (height - 20) / top;
    html! {
        svg.chart #throughput width=(width) height=(height) viewBox={ "0 0 " (width) " " (height) } role="img"
            aria-label="Jobs finished per minute, last 30 minutes" {
            @for i in 0..minutes {
                @let x = 10 + i as u64 * bar;
                @let ok_h = scale(ok[i]);
                @let bad_h = scale(bad[i]);
                rect.completed x=(x) y=(height - 14 - ok_h) width=(bar - 4) height=(ok_h) {
                    title { (ok[i]) " completed" }
                }
                rect.dead x=(x) y=(height - 14 - ok_h - bad_h) width=(bar - 4) height=(bad_h) {
                    title { (bad[i]) " dead" }
                }
            }
            text x="10" y=(height - 2) { "-30 min" }
            text x=(width - 40) y=(height - 2) { "now" }
            text x="10" y="12" { "max " (top) "/min" }
        }
        p.legend { span.completed { "completed" } span.dead { "dead" } }
    }
}

/// `GET /queue?name=Q`: one queue.
pub fn queue_page(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    incoming: &Incoming,
    notice: Option<&str>,
) -> Result<Reply, Error> {
    let name = required(incoming, "name")?;
    let bound = COUNT_BOUND;
    let counts: QueueCounts = jobs::queue_counts(conn, name, bound)?;
    let paused = jobs::is_paused(conn, name)?;
    let now = tenure::database_now(conn)?;
    let since = now - chrono::Duration::minutes(CHART_MINUTES);
    let completed = finishes(conn, name, JobState::Completed, since)?;
    let dead = finishes(conn, name, JobState::Dead, since)?;
    let mut dead_kinds: BTreeMap<String, u64> = BTreeMap::new();
    for kind in tenure_jobs::table
        .filter(tenure_jobs::queue.eq(name))
        .filter(tenure_jobs::state.eq(JobState::Dead))
        .select(tenure_jobs::kind)
        .limit(DEAD_SAMPLE)
        .load::<String>(conn)?
    {
        *dead_kinds.entry(kind).or_default() += 1;
    }
    let cards = [
        ("Blocked", JobState::Blocked, counts.blocked),
        ("Waiting", JobState::Waiting, counts.waiting),
        ("Running", JobState::Running, counts.running),
        ("Parked", JobState::Parked, counts.parked),
        ("Completed", JobState::Completed, counts.completed),
        ("Dead", JobState::Dead, counts.dead),
        ("Cancelled", JobState::Cancelled, counts.cancelled),
    ];
    let content = html! {
        div.actions {
            @if paused {
                span.state.paused #queue-state { "paused" } " Claims skip this queue; enqueues still work. "
                (action(dashboard, "/queue/resume", &[("name", name)], "Resume", false))
            } @else {
                span.state.completed #queue-state { "active" } " "
                (action(dashboard, "/queue/pause", &[("name", name)], "Pause", true))
            }
        }
        div.cards {
            @for (label, state, count) in cards {
                div.card {
                    div.n { (count_link(name, state, count, bound)) }
                    div.label { (label) @if state == JobState::Waiting { " (" (bounded(counts.due, bound)) " due)" } }
                }
            }
        }
        h2 { "Finished per minute" }
        (chart(&completed, &dead, now))
        @if completed.len() as i64 >= CHART_BOUND || dead.len() as i64 >= CHART_BOUND {
            p.muted { "The chart counts the latest " (thousands(CHART_BOUND as u64)) " finishes of each state; older minutes may show fewer than ran." }
        }
        h2 { "Dead jobs" }
        @if dead_kinds.is_empty() {
            p.muted { "None." }
        } @else {
            table #dead-kinds {
                thead { tr { th { "Kind" } th.num { "Dead (of the first " (thousands(DEAD_SAMPLE as u64)) " read)" } th { "" } } }
                tbody {
                    @for (kind, n) in &dead_kinds {
                        tr {
                            td { a href=(link("/jobs", &[("queue", name), ("kind", kind), ("state", "dead")])) { (kind) } }
                            td.num { (n) }
                            td { (action(dashboard, "/queue/retry-dead", &[("name", name), ("kind", kind)], "Retry all dead of this kind", false)) }
                        }
                    }
                }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(
            dashboard,
            Section::Queues,
            &format!("Queue {name}"),
            notice,
            content,
        ),
    ))
}

/// `POST /queue/pause`, `/queue/resume`, `/queue/retry-dead`: then back to the queue.
pub fn act(conn: &mut AnyConnection, incoming: &Incoming) -> Result<Reply, Error> {
    let name = required(incoming, "name")?;
    let (done, n) = match incoming.path.as_str() {
        "/queue/pause" => {
            jobs::pause(conn, name)?;
            ("queue-paused", 0)
        }
        "/queue/resume" => {
            jobs::resume(conn, name)?;
            ("queue-resumed", 0)
        }
        _ => {
            let kind = required(incoming, "kind")?;
            ("retried", jobs::retry_dead_of_kind(conn, name, kind)?)
        }
    };
    Ok(Reply::see_other(link(
        "/queue",
        &[("name", name), ("done", done), ("n", &n.to_string())],
    )))
}

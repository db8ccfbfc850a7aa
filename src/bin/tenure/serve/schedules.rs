//! Schedules: when each ticks next, and pause/resume.

use maud::html;
use tenure::schedules::{self, Spec};
use tenure::{AnyConnection, Error};

use super::http::{Incoming, Reply, link};
use super::layout::{Section, action, instant, maybe_instant, page};
use super::{Dashboard, required};

/// `GET /schedules`.
pub fn list(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    notice: Option<&str>,
) -> Result<Reply, Error> {
    let all = schedules::list(conn)?;
    let now = tenure::database_now(conn)?;
    let content = html! {
        @if all.is_empty() {
            p.muted { "No schedules." }
        } @else {
            table #schedules {
                thead { tr { th { "Name" } th { "When" } th { "Job" } th title="The tick before the next one, by the schedule's timing: tenure does not record when a schedule fired" { "Tick before next" } th { "Next tick" } th { "" } } }
                tbody {
                    @for schedule in &all {
                        tr data-schedule=(schedule.name) {
                            td { (schedule.name)
                                @if schedule.paused { " " span.state.paused { "paused" } } }
                            td { @match &schedule.spec {
                                Spec::Cron(expression) => { code { (expression) } " " span.muted { (schedule.time_zone) } },
                                Spec::Every(every) => { "every " (crate::duration::format_duration(*every)) },
                            } }
                            td { a href=(link("/queue", &[("name", &schedule.queue)])) { (schedule.queue) } " · " (schedule.kind) }
                            td { (maybe_instant(schedule.previous_tick, now)) }
                            td { (instant(schedule.next_due_at, now)) }
                            td {
                                @if schedule.paused {
                                    (action(dashboard, "/schedule/resume", &[("name", &schedule.name)], "Resume", false))
                                } @else {
                                    (action(dashboard, "/schedule/pause", &[("name", &schedule.name)], "Pause", true))
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(dashboard, Section::Schedules, "Schedules", notice, content),
    ))
}

/// `POST /schedule/pause`, `/schedule/resume`: then back to the schedules.
pub fn act(conn: &mut AnyConnection, incoming: &Incoming) -> Result<Reply, Error> {
    let name = required(incoming, "name")?;
    let changed = if incoming.path == "/schedule/pause" {
        schedules::pause(conn, name)?
    } else {
        schedules::resume(conn, name)?
    };
    let done = match (incoming.path == "/schedule/pause", changed) {
        (_, false) => "no-schedule",
        (true, true) => "schedule-paused",
        (false, true) => "schedule-resumed",
    };
    Ok(Reply::see_other(link("/schedules", &[("done", done)])))
}

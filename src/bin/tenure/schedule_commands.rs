//! `tenure schedules`: list, add, pause, resume and remove recurring schedules.

use clap::{ArgGroup, Subcommand};
use serde_json::json;
use tenure::Pool;
use tenure::schedules::{self, Schedule};

use crate::duration::{format_duration, parse_flag_bounded};
use crate::enqueue::{JobArgs, new_job};
use crate::output::{Out, table};
use crate::{Failure, Outcome};

#[derive(Subcommand)]
pub enum SchedulesCommand {
    /// Every schedule and its next tick.
    List,
    /// Add (or replace) a schedule: --cron or --every, one of them.
    #[command(group(ArgGroup::new("when").required(true).args(["cron", "every"])))]
    Add {
        name: String,
        /// A cron expression: 5 fields (minute hour day-of-month month day-of-week), or 6
        /// with seconds first, e.g. '0 3 * * *' (03:00 every day).
        #[arg(long)]
        cron: Option<String>,
        /// A fixed interval: a whole number and a unit, ms, s, m, h or d (e.g. 30s, 5m, 1h).
        #[arg(long)]
        every: Option<String>,
        /// IANA time zone of the cron expression.
        #[arg(long, default_value = "UTC")]
        time_zone: String,
        #[command(flatten)]
        job: Box<JobArgs>,
    },
    /// Pause a schedule.
    Pause { name: String },
    /// Resume a paused schedule.
    Resume { name: String },
    /// Remove a schedule.
    Remove { name: String },
}

/// A cron expression's fields, in order, with what each accepts.
const FIELDS: [(&str, &str); 6] = [
    ("second", "0-59"),
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day of month", "1-31"),
    ("month", "1-12 or JAN-DEC"),
    ("day of week", "0-7 or SUN-SAT, 0 and 7 both Sunday"),
];

const CRON_SYNTAX: &str = "5 fields (minute hour day-of-month month day-of-week) or 6 with \
    seconds first; each field is *, a number, a range 1-5, a list 1,3,5 or a step */15";

fn cron_parses(expression: &str) -> Result<(), String> {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .build()
        .parse(expression)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Whether the expression has a tick ahead (in UTC; the library checks the time zone's).
fn next_tick(expression: &str) -> bool {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .build()
        .parse(expression)
        .is_ok_and(|cron| {
            cron.find_next_occurrence(&chrono::Utc::now(), false)
                .is_ok()
        })
}

/// Checks a cron expression, naming the field at fault (each is tried alone, the others
/// `*`) and the syntax, instead of the parser's "Component error: Number out of bounds".
fn check_cron(expression: &str) -> Result<(), Failure> {
    let parts: Vec<&str> = expression.split_whitespace().collect();
    let fail = |what: String| {
        Failure::new(
            2,
            format!("--cron {expression:?}: {what}; use {CRON_SYNTAX}"),
        )
    };
    if !(parts.len() == 5 || parts.len() == 6) {
        return Err(fail(format!("{} field(s)", parts.len())));
    }
    let Err(whole) = cron_parses(expression) else {
        // It parses, but a date that never comes (31 February) never fires.
        return match next_tick(expression) {
            true => Ok(()),
            false => Err(fail(
                "it never fires (no date matches its day and month, e.g. 30 or 31 February)"
                    .to_string(),
            )),
        };
    };
    let names = &FIELDS[6 - parts.len()..];
    for (i, (part, (name, range))) in parts.iter().zip(names).enumerate() {
        let alone: Vec<&str> = (0..parts.len())
            .map(|j| if i == j { *part } else { "*" })
            .collect();
        if cron_parses(&alone.join(" ")).is_err() {
            return Err(fail(format!(
                "the {name} field {part:?} is not valid (it takes {range})"
            )));
        }
    }
    Err(fail(format!("the fields do not fit together ({whole})")))
}

/// `--every`: 1 ms to 366 days.
fn parse_every(text: &str) -> Result<std::time::Duration, Failure> {
    parse_flag_bounded("--every", text, std::time::Duration::from_millis(1))
}

/// `--time-zone`: an IANA name, checked before the database is opened.
fn check_time_zone(zone: &str) -> Result<(), Failure> {
    zone.parse::<chrono_tz::Tz>().map(drop).map_err(|_| {
        Failure::new(
            2,
            format!("--time-zone {zone:?} is not an IANA time zone (e.g. UTC, Europe/Paris)"),
        )
    })
}

pub fn run(
    open: impl FnOnce() -> Result<Pool, Failure>,
    command: SchedulesCommand,
    out: &Out,
) -> Outcome {
    // `add` checks its arguments before the database is opened.
    if let SchedulesCommand::Add {
        cron,
        every,
        job,
        time_zone,
        ..
    } = &command
    {
        new_job(job)?;
        check_time_zone(time_zone)?;
        match (cron, every) {
            (Some(expr), _) => check_cron(expr)?,
            (None, Some(every)) => drop(parse_every(every)?),
            (None, None) => return Err(Failure::new(2, "give --cron or --every")),
        }
    }
    let mut conn = open()?.get()?;
    let changed = |done: bool, name: &str, what: &str| -> Outcome {
        if !done {
            return Err(Failure::new(1, format!("no schedule {name:?}")));
        }
        out.print(json!({what: name}), || format!("{what} {name:?}"))
    };
    match command {
        SchedulesCommand::List => {
            let list = schedules::list(&mut conn)?;
            let spec = |s: &schedules::ScheduleInfo| match &s.spec {
                schedules::Spec::Cron(expr) => format!("cron {expr} ({})", s.time_zone),
                schedules::Spec::Every(every) => format!("every {}", format_duration(*every)),
            };
            out.print(
                json!(list.iter().map(|s| json!({"name": s.name, "when": spec(s), "queue": s.queue, "kind": s.kind,
                    "paused": s.paused, "next_due_at": s.next_due_at})).collect::<Vec<_>>()),
                || {
                    table(
                        &["name", "when", "queue", "kind", "paused", "next tick"],
                        list.iter().map(|s| {
                            vec![
                                s.name.clone(),
                                spec(s),
                                s.queue.clone(),
                                s.kind.clone(),
                                if s.paused { "yes".into() } else { String::new() },
                                s.next_due_at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
                            ]
                        }),
                    )
                },
            )
        }
        SchedulesCommand::Add {
            name,
            cron,
            every,
            time_zone,
            job,
        } => {
            let job = new_job(&job)?;
            let schedule = match (cron, every) {
                (Some(expr), _) => {
                    check_cron(&expr)?;
                    Schedule::cron(name.as_str(), expr, job).time_zone(time_zone)
                }
                (None, Some(every)) => Schedule::every(name.as_str(), parse_every(&every)?, job),
                (None, None) => return Err(Failure::new(2, "give --cron or --every")),
            };
            schedules::upsert(&mut conn, &schedule)?;
            out.print(json!({"added": name}), || {
                format!("schedule {name:?} added")
            })
        }
        SchedulesCommand::Pause { name } => {
            changed(schedules::pause(&mut conn, &name)?, &name, "paused")
        }
        SchedulesCommand::Resume { name } => {
            changed(schedules::resume(&mut conn, &name)?, &name, "resumed")
        }
        SchedulesCommand::Remove { name } => {
            changed(schedules::remove(&mut conn, &name)?, &name, "removed")
        }
    }
}

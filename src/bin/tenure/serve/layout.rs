//! The page shell and the small pieces every page uses. maud escapes every value it
//! interpolates: payloads, errors and names are attacker-controlled, and nothing here marks
//! them as safe.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::Dashboard;

pub const CSS: &str = include_str!("assets/dashboard.css");
pub const JS: &str = include_str!("assets/dashboard.js");

/// Which part of the dashboard a page belongs to (its tab is marked).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Queues,
    Jobs,
    Leases,
    Schedules,
    Workers,
}

const TABS: &[(Section, &str, &str)] = &[
    (Section::Queues, "/", "Queues"),
    (Section::Jobs, "/jobs", "Jobs"),
    (Section::Leases, "/leases", "Leases"),
    (Section::Schedules, "/schedules", "Schedules"),
    (Section::Workers, "/workers", "Workers"),
];

/// A whole page: navigation, a notice after an action, the content.
pub fn page(
    dashboard: &Dashboard,
    section: Section,
    title: &str,
    notice: Option<&str>,
    content: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · tenure" }
                link rel="stylesheet" href="/assets/dashboard.css";
                script src="/assets/dashboard.js" defer {}
            }
            body {
                header {
                    a.brand href="/" { "tenure" }
                    nav {
                        @for (tab, href, label) in TABS {
                            a href=(href) class=[(*tab == section).then_some("current")] { (label) }
                        }
                    }
                    form.goto method="get" action="/job" {
                        input type="number" name="id" min="1" placeholder="Job id" aria-label="Job id";
                    }
                    span.meta {
                        (dashboard.backend.to_string())
                        @if dashboard.read_only { " · read-only" }
                    }
                    label.refresh {
                        input #auto-refresh type="checkbox";
                        " auto-refresh"
                    }
                }
                main {
                    h1 { (title) }
                    @if let Some(notice) = notice {
                        p.notice role="status" { (notice) }
                    }
                    (content)
                }
            }
        }
    }
}

/// A button that posts `fields` to `action` with the CSRF token; nothing when read-only.
pub fn action(
    dashboard: &Dashboard,
    action: &str,
    fields: &[(&str, &str)],
    label: &str,
    danger: bool,
) -> Markup {
    if dashboard.read_only {
        return html! {};
    }
    html! {
        form.action method="post" action=(action) {
            input type="hidden" name="csrf" value=(dashboard.access.csrf());
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            button type="submit" class=[danger.then_some("danger")] { (label) }
        }
    }
}

/// A bounded count: "10,000+" when it reached the bound.
pub fn bounded(count: u64, bound: u32) -> String {
    if count >= u64::from(bound) {
        format!("{}+", thousands(count))
    } else {
        thousands(count)
    }
}

/// 1234567 as "1,234,567".
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// An instant as UTC, with how far it is from the database's `now`.
pub fn instant(at: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    html! {
        time datetime=(at.to_rfc3339()) title=(at.to_rfc3339()) {
            (at.format("%Y-%m-%d %H:%M:%S UTC")) " "
            span.relative { "(" (relative(at - now)) ")" }
        }
    }
}

/// An optional instant, or a dash.
pub fn maybe_instant(at: Option<DateTime<Utc>>, now: DateTime<Utc>) -> Markup {
    match at {
        Some(at) => instant(at, now),
        None => html! { "–" },
    }
}

/// "in 5s", "3m ago"; "now" within a second either way (not "in 0s").
pub fn relative(delta: chrono::Duration) -> String {
    let seconds = delta.num_seconds();
    if seconds == 0 {
        return "now".to_string();
    }
    let span = seconds.unsigned_abs();
    let text = match span {
        0..=59 => format!("{span}s"),
        60..=3599 => format!("{}m", span / 60),
        3600..=172_799 => format!("{}h", span / 3600),
        _ => format!("{}d", span / 86_400),
    };
    if seconds >= 0 {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

/// A job state as a coloured badge.
pub fn state_badge(state: &str) -> Markup {
    html! { span class={ "state " (state) } { (state) } }
}

#[cfg(test)]
mod tests {
    use super::relative;

    #[test]
    fn an_instant_within_a_second_is_now() {
        assert_eq!(relative(chrono::Duration::milliseconds(400)), "now");
        assert_eq!(relative(chrono::Duration::milliseconds(-900)), "now");
        assert_eq!(relative(chrono::Duration::seconds(5)), "in 5s");
        assert_eq!(relative(chrono::Duration::seconds(-180)), "3m ago");
    }
}

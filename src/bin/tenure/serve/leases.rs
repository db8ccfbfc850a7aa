//! Leases: who holds each, its fence and expiry, and a force-release behind a confirmation.

use maud::html;
use tenure::{AnyConnection, Error, lease};

use super::http::{Incoming, Reply, link};
use super::layout::{Section, action, instant, page};
use super::{Dashboard, required};

/// The most leases listed (by name).
const MAX_LEASES: usize = 1_000;

/// `GET /leases`.
pub fn list(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    notice: Option<&str>,
) -> Result<Reply, Error> {
    let leases = lease::list(conn)?;
    let content = html! {
        @if leases.is_empty() {
            p.muted { "No lease was ever taken." }
        } @else {
            table #leases {
                thead { tr { th { "Name" } th { "State" } th { "Holder" } th.num { "Fence" } th { "Value" } th { "Acquired" } th { "Expires" } th { "" } } }
                tbody {
                    @for info in leases.iter().take(MAX_LEASES) {
                        tr data-lease=(info.name) {
                            td { (info.name) @if info.slot > 0 { " #" (info.slot) } }
                            td { @if info.held { span.state.running { "held" } } @else { span.state.completed { "free" } } }
                            td { (info.holder) }
                            td.num { (info.fence) }
                            td { (info.value.as_deref().unwrap_or("")) }
                            td { (instant(info.acquired_at, info.now)) }
                            td { (instant(info.expires_at, info.now)) }
                            td { @if info.held && !dashboard.read_only {
                                a href=(link("/lease/release", &[("name", &info.name)])) { "Force release…" }
                            } }
                        }
                    }
                }
            }
            @if leases.len() > MAX_LEASES {
                p.muted { "The first " (MAX_LEASES) " of " (leases.len()) " leases, by name." }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(dashboard, Section::Leases, "Leases", notice, content),
    ))
}

/// `GET /lease/release?name=L`: what releasing would do, and the button that does it.
pub fn confirm(
    dashboard: &Dashboard,
    conn: &mut AnyConnection,
    incoming: &Incoming,
) -> Result<Reply, Error> {
    let name = required(incoming, "name")?;
    let info = lease::inspect(conn, name)?;
    let content = html! {
        @match &info {
            None => p #missing { "No lease of this name was ever taken." },
            Some(info) => {
                p { "Lease " strong { (info.name) } " is "
                    @if info.held { "held by " strong { (info.holder) } " (fence " (info.fence) "), until " (instant(info.expires_at, info.now)) "." }
                    @else { "not held." } }
                p.error { "Releasing it takes it from its holder while the holder may still be working: \
                    its renewals and releases then fail as lost, and someone else can take it at once. \
                    Do this only when you know the holder is gone or stuck." }
                (action(dashboard, "/lease/release", &[("name", &info.name), ("confirm", "yes")], "Release it now", true))
                " " a href="/leases" { "Cancel" }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(
            dashboard,
            Section::Leases,
            "Force-release a lease",
            None,
            content,
        ),
    ))
}

/// `POST /lease/release` (with `confirm=yes`): then back to the leases.
pub fn act(conn: &mut AnyConnection, incoming: &Incoming) -> Result<Reply, Error> {
    let name = required(incoming, "name")?;
    if incoming.field("confirm") != Some("yes") {
        return Err(super::invalid(
            "confirm",
            "a force-release needs its confirmation (confirm=yes)",
        ));
    }
    let done = if lease::force_release(conn, name)? {
        "released"
    } else {
        "not-held"
    };
    Ok(Reply::see_other(link("/leases", &[("done", done)])))
}

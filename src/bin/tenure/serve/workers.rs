//! Workers: the registered worker processes, their heartbeats, and whether their lock was
//! last seen free.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use maud::html;
use tenure::schema::tenure_workers;
use tenure::{AnyConnection, Error};

use super::Dashboard;
use super::http::Reply;
use super::layout::{Section, instant, maybe_instant, page};

/// The most workers listed (newest first).
const MAX_WORKERS: i64 = 500;

/// `GET /workers`.
pub fn list(dashboard: &Dashboard, conn: &mut AnyConnection) -> Result<Reply, Error> {
    type Row = (
        i64,
        String,
        i64,
        DateTime<Utc>,
        DateTime<Utc>,
        Option<DateTime<Utc>>,
    );
    let rows: Vec<Row> = tenure_workers::table
        .select((
            tenure_workers::id,
            tenure_workers::host,
            tenure_workers::pid,
            tenure_workers::started_at,
            tenure_workers::heartbeat_at,
            tenure_workers::lock_free_since,
        ))
        .order(tenure_workers::id.desc())
        .limit(MAX_WORKERS)
        .load(conn)?;
    let now = tenure::database_now(conn)?;
    let content = html! {
        @if rows.is_empty() {
            p.muted { "No worker is registered (workers register while they run)." }
        } @else {
            table #workers {
                thead { tr { th.num { "Id" } th { "Host" } th.num { "Pid" } th { "Started" } th { "Heartbeat" } th { "Lock seen free since" } } }
                tbody {
                    @for (id, host, pid, started, beat, free) in &rows {
                        tr { td.num { (id) } td { (host) } td.num { (pid) }
                            td { (instant(*started, now)) } td { (instant(*beat, now)) } td { (maybe_instant(*free, now)) } }
                    }
                }
            }
        }
    };
    Ok(Reply::html(
        200,
        page(dashboard, Section::Workers, "Workers", None, content),
    ))
}

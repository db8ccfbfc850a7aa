//! `tenure serve`'s pages against hostile data: NUL bytes and oversized names are bad input,
//! stored markup is escaped on every page, a database error is a 500 and the server serves on.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobResult, JobState, NewJob};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, lease};

use crate::common::{TestDb, conformance, poll_until};
use crate::dashboard::{Answer, csrf, get, post, serve};
use crate::serve::{dead_job, state};

conformance!(
    nul_in_a_jobs_filter_is_bad_input,
    nul_and_oversized_names_are_bad_input_everywhere_else,
    stored_markup_is_escaped_on_every_page,
    a_database_error_is_a_500_and_the_server_serves_on,
);

fn encode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

fn held(conn: &mut AnyConnection, name: &str) -> bool {
    lease::inspect(conn, name)
        .unwrap()
        .is_some_and(|info| info.held)
}

/// NUL can be in no queue, kind or text tenure stores (names are checked), yet the jobs list
/// passes it to the database: PostgreSQL then fails the query (a 500 "Database error" for bad
/// input), the others say no job matches. Like an over-long filter, it should be a 400.
fn nul_in_a_jobs_filter_is_bad_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![])).unwrap();
    let served = serve(db.url(), &[], &[]);
    for path in ["/jobs?queue=a%00b", "/jobs?kind=a%00b", "/jobs?text=a%00b"] {
        let answer = get(&served.base, path);
        assert_eq!(answer.status, 400, "{backend} {path}: {}", answer.body);
        assert!(
            answer.body.contains("NUL"),
            "{backend} {path}: {}",
            answer.body
        );
    }
}

/// Names with NUL or too long, everywhere but the jobs list's filters: a 400 that says so,
/// and nothing changed.
fn nul_and_oversized_names_are_bad_input_everywhere_else(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let dead = dead_job(&mut conn, "q", "k", b"{}", "boom");
    lease::try_take(&mut conn, "l", Duration::from_secs(600), "me")
        .unwrap()
        .unwrap();
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let long = "n".repeat(10 * 1024);
    for path in [
        "/queue?name=q%00".to_string(),
        format!("/queue?name={long}"),
        "/lease/release?name=l%00".into(),
        format!("/lease/release?name={long}"),
    ] {
        let answer = get(base, &path);
        assert_eq!(
            answer.status,
            400,
            "{backend} {}: {}",
            &path[..path.len().min(40)],
            answer.body
        );
    }
    let token = csrf(&get(base, &format!("/job?id={dead}")).body);
    let nul = "q\0";
    let actions: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("/queue/pause", vec![("name", nul)]),
        ("/queue/pause", vec![("name", &long)]),
        ("/queue/resume", vec![("name", nul)]),
        ("/queue/retry-dead", vec![("name", "q"), ("kind", "k\0")]),
        ("/queue/retry-dead", vec![("name", "q\0"), ("kind", "k")]),
        ("/queue/retry-dead", vec![("name", "q"), ("kind", &long)]),
        ("/schedule/pause", vec![("name", "s\0")]),
        ("/schedule/resume", vec![("name", &long)]),
        ("/lease/release", vec![("name", "l\0"), ("confirm", "yes")]),
        ("/lease/release", vec![("name", &long), ("confirm", "yes")]),
    ];
    for (path, mut fields) in actions {
        fields.push(("csrf", &token));
        let answer = post(base, path, &fields);
        assert_eq!(answer.status, 400, "{backend} {path}: {}", answer.body);
        assert!(answer.body.contains("Bad request"), "{}", answer.body);
    }
    assert_eq!(state(&mut conn, dead), JobState::Dead);
    assert!(held(&mut conn, "l"));
    assert!(!jobs::is_paused(&mut conn, "q").unwrap());
}

/// Markup in every stored value the earlier tests do not cover (schedule names, queues and
/// kinds, lease names and holders on the confirmation page, limit keys, dedup keys, progress
/// messages, results, outputs, dead kinds), and a `javascript:` queue name in a link.
fn stored_markup_is_escaped_on_every_page(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let queue = "javascript:alert(1)//<svg onload=alert(1)>";
    let kind = "</pre></textarea><script>alert(1)</script>";
    let key = "]]><img src=x onerror=alert(1)>";
    let text = "\"><svg/onload=alert(1)></title><script>alert(1)</script>";
    let dead = dead_job(&mut conn, queue, kind, text.as_bytes(), text);
    let running = jobs::enqueue(
        &mut conn,
        &NewJob::new(queue, kind, vec![])
            .limit(key, 1)
            .dedup_key(key),
    )
    .unwrap()
    .id;
    let done = jobs::enqueue(&mut conn, &NewJob::new(queue, kind, vec![]))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, queue, 10, Duration::from_secs(600)).unwrap();
    for job in &claimed {
        if job.id == running {
            jobs::record_progress(&mut conn, job.claim(), 0.5, text).unwrap();
        } else if job.id == done {
            jobs::record_output(&mut conn, done, 1, Some(0), text.as_bytes()).unwrap();
            jobs::complete_with_result(
                &mut conn,
                job.claim(),
                &JobResult::bytes(text.as_bytes().to_vec()).unwrap(),
            )
            .unwrap();
        }
    }
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            key,
            Duration::from_secs(3600),
            NewJob::new(queue, kind, vec![]),
        ),
    )
    .unwrap();
    lease::try_take(&mut conn, key, Duration::from_secs(600), text)
        .unwrap()
        .unwrap();
    let served = serve(db.url(), &[], &[]);
    let pages = [
        "/".to_string(),
        "/jobs".into(),
        format!(
            "/jobs?queue={}&kind={}&text={}",
            encode(queue),
            encode(kind),
            encode(text)
        ),
        format!("/job?id={dead}"),
        format!("/job?id={running}"),
        format!("/job?id={done}"),
        format!("/queue?name={}", encode(queue)),
        "/leases".into(),
        format!("/lease/release?name={}", encode(key)),
        "/schedules".into(),
    ];
    for path in &pages {
        let page = get(&served.base, path);
        assert_eq!(page.status, 200, "{backend} {path}: {}", page.body);
        for bad in [
            "<svg onload",
            "<svg/onload",
            "<img",
            "<script>",
            "</textarea",
            "href=\"javascript:",
            "onload=alert(1)>",
        ] {
            assert!(
                !page.body.contains(bad),
                "{backend} {path} holds {bad:?} unescaped"
            );
        }
        assert_eq!(
            page.body.matches("<script").count(),
            1,
            "{backend} {path}: one script, the dashboard's"
        );
    }
    // The values are there, as text.
    let page = get(&served.base, &format!("/job?id={running}")).body;
    assert!(
        page.contains("]]&gt;&lt;img src=x onerror=alert(1)&gt;"),
        "{page}"
    );
    let page = get(&served.base, "/schedules").body;
    assert!(
        page.contains("href=\"/queue?name=javascript%3Aalert%281%29"),
        "{page}"
    );
    let page = get(&served.base, &format!("/job?id={done}")).body;
    assert!(
        page.matches("&lt;svg/onload=alert(1)&gt;").count() >= 2,
        "{page}"
    );
}

/// A database error is a 500 "Database error" page, never an empty list or "no such" page;
/// its log line names no URL; the other pages keep working, and on a server the dashboard
/// recovers when its connections are killed under it.
fn a_database_error_is_a_500_and_the_server_serves_on(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    lease::try_take(&mut conn, "l", Duration::from_secs(600), "me")
        .unwrap()
        .unwrap();
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "s",
            Duration::from_secs(3600),
            NewJob::new("q", "k", vec![]),
        ),
    )
    .unwrap();
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    for path in ["/leases", "/lease/release?name=l", "/schedules", "/"] {
        assert_eq!(get(base, path).status, 200, "{path}");
    }
    let token = csrf(&get(base, &format!("/job?id={id}")).body);
    conn.batch_execute("DROP TABLE tenure_leases").unwrap();
    for path in ["/leases", "/lease/release?name=l"] {
        let answer = get(base, path);
        assert_eq!(answer.status, 500, "{backend} {path}: {}", answer.body);
        assert!(answer.body.contains("Database error"), "{}", answer.body);
        assert!(!answer.body.contains("No lease"), "{}", answer.body);
        assert!(!answer.body.contains(db.url()), "{}", answer.body);
    }
    let answer = post(
        base,
        "/lease/release",
        &[("csrf", &token), ("name", "l"), ("confirm", "yes")],
    );
    assert_eq!(answer.status, 500, "{backend}: {}", answer.body);
    // The rest of the dashboard is untouched.
    assert_eq!(get(base, "/schedules").status, 200);
    assert_eq!(get(base, &format!("/job?id={id}")).status, 200);
    let log = served.log();
    assert!(log.contains("a page failed"), "{log}");
    assert!(log.contains("GET /leases 500"), "{log}");
    assert!(!log.contains(db.url()), "{log}");

    if backend != Backend::Sqlite {
        // Kill every connection the dashboard holds.
        let kill = match backend {
            Backend::Postgres => "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                                  WHERE datname = current_database() AND pid <> pg_backend_pid()"
                .to_string(),
            _ => {
                use diesel::prelude::*;
                #[derive(QueryableByName)]
                struct Id {
                    #[diesel(sql_type = diesel::sql_types::BigInt)]
                    id: i64,
                }
                let ids: Vec<Id> = diesel::sql_query(
                    "SELECT CAST(id AS SIGNED) AS id FROM information_schema.processlist \
                     WHERE db = DATABASE() AND id <> CONNECTION_ID()",
                )
                .load(&mut conn)
                .unwrap();
                assert!(!ids.is_empty(), "the dashboard holds connections");
                ids.iter()
                    .map(|row| format!("KILL {};", row.id))
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        };
        conn.batch_execute(&kill).unwrap();
        let mut refused = String::new();
        poll_until(Duration::from_secs(60), Duration::from_millis(200), || {
            let answer = get(base, "/schedules");
            assert!(
                matches!(answer.status, 200 | 500),
                "{backend}: {} {}",
                answer.status,
                answer.body
            );
            if answer.status == 200 {
                assert!(
                    answer.body.contains("data-schedule=\"s\""),
                    "{}",
                    answer.body
                );
                return Some(());
            }
            refused = answer.body;
            None
        })
        .unwrap_or_else(|| panic!("{backend}: the dashboard did not recover: {refused}"));
        // Every handler thread gets its connection back.
        for _ in 0..8 {
            assert_eq!(get(base, &format!("/job?id={id}")).status, 200);
        }
    } else {
        // SQLite: another table gone under the pool's open connections.
        conn.batch_execute("DROP TABLE tenure_schedules").unwrap();
        let answer = get(base, "/schedules");
        assert_eq!(answer.status, 500, "{}", answer.body);
        assert!(!answer.body.contains("No schedules"), "{}", answer.body);
        assert_eq!(get(base, &format!("/job?id={id}")).status, 200);
    }
    let answer: Answer = get(base, "/");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(!served.log().contains("panicked"));
}

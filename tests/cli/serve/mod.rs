//! `tenure serve` over HTTP on every backend: every page, every action and what it changes,
//! bad input, escaping, the jobs list's paging, and SIGTERM; what guards the pages and actions
//! (the CSRF token, other origins, read-only, credentials) in `guards.rs`.

mod access;
mod floods;
mod framing;
mod guards;
mod log;
mod pages;
mod raw_server;
mod requests;
mod sequences;
mod slow_readers;

use std::time::Duration;

use tenure::jobs::{self, JobState, NewJob, Retry};
use tenure::schedules::{self, Schedule};
use tenure::{AnyConnection, Backend, lease};

use crate::common::{TestDb, conformance};
use crate::dashboard::{Answer, csrf, get, post, serve};

conformance!(
    every_page_renders_and_every_action_changes_the_database,
    bad_input_gets_a_clear_error_and_changes_nothing,
    stored_markup_is_shown_as_text,
    the_jobs_list_pages_by_id_and_filters,
);

const HOSTILE: &str =
    "<script>window.__pwned=1</script>\"><img src=x onerror=\"window.__pwned=1\">";

/// A dead job of `queue` and `kind`, with `error` as its failed run's error.
pub(crate) fn dead_job(
    conn: &mut AnyConnection,
    queue: &str,
    kind: &str,
    payload: &[u8],
    error: &str,
) -> i64 {
    let id = jobs::enqueue(
        conn,
        &NewJob::new(queue, kind, payload.to_vec()).max_attempts(1),
    )
    .unwrap()
    .id;
    let claimed = jobs::claim(conn, queue, 100, Duration::from_secs(60)).unwrap();
    let mine = claimed.iter().find(|job| job.id == id).expect("claimed");
    jobs::fail(conn, mine.claim(), error, Retry::Never).unwrap();
    for other in claimed.iter().filter(|job| job.id != id) {
        jobs::give_back(conn, &[other.claim()]).unwrap();
    }
    id
}

pub(crate) fn state(conn: &mut AnyConnection, id: i64) -> JobState {
    jobs::get(conn, id).unwrap().unwrap().state
}

/// Where a 303 leads.
fn location(answer: &Answer) -> &str {
    assert_eq!(answer.status, 303, "{}", answer.body);
    answer.header("Location").expect("a Location")
}

fn every_page_renders_and_every_action_changes_the_database(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let waiting = jobs::enqueue(
        &mut conn,
        &NewJob::new("mail", "send", br#"{"to":"a@b"}"#.to_vec()),
    )
    .unwrap()
    .id;
    let dead = dead_job(
        &mut conn,
        "reports",
        "render",
        b"\x00\x01binary",
        "disk full",
    );
    let dead_too = dead_job(&mut conn, "reports", "render", b"{}", "disk full again");
    jobs::limit_queue(&mut conn, "reports", Some(2)).unwrap();
    let held = lease::try_take(
        &mut conn,
        "nightly-backup",
        Duration::from_secs(600),
        "host-a",
    )
    .unwrap()
    .expect("a free lease");
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "digest",
            Duration::from_secs(3600),
            NewJob::new("mail", "digest", vec![]),
        ),
    )
    .unwrap();
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;

    // Every page, with what it must show.
    let pages: &[(&str, &[&str])] = &[
        (
            "/",
            &[
                "data-queue=\"mail\"",
                "data-queue=\"reports\"",
                "Limit keys",
            ],
        ),
        (
            "/queue?name=reports",
            &["id=\"throughput\"", "id=\"dead-kinds\"", "render"],
        ),
        (
            "/jobs",
            &[
                &format!("data-id=\"{waiting}\""),
                &format!("data-id=\"{dead}\""),
            ],
        ),
        (
            "/jobs?queue=reports&state=dead",
            &[&format!("data-id=\"{dead_too}\"")],
        ),
        (
            &format!("/job?id={dead}"),
            &["disk full", "00000000  00 01", "id=\"errors\""],
        ),
        (
            &format!("/job?id={waiting}"),
            &["&quot;to&quot;: &quot;a@b&quot;"],
        ),
        ("/leases", &["data-lease=\"nightly-backup\"", "host-a"]),
        ("/lease/release?name=nightly-backup", &["Release it now"]),
        ("/schedules", &["data-schedule=\"digest\"", "every"]),
        ("/workers", &["No worker is registered"]),
        ("/assets/dashboard.css", &["tenure serve"]),
        ("/assets/dashboard.js", &["auto-refresh"]),
    ];
    for (path, wanted) in pages {
        let page = get(base, path);
        assert_eq!(page.status, 200, "{path}: {}", page.body);
        for text in *wanted {
            assert!(
                page.body.contains(text),
                "{path} lacks {text:?}:\n{}",
                page.body
            );
        }
        assert!(
            page.header("Content-Security-Policy")
                .is_some_and(|csp| csp.contains("frame-ancestors 'none'")),
            "{path}"
        );
        assert_eq!(page.header("X-Frame-Options"), Some("DENY"), "{path}");
    }
    assert_eq!(get(base, "/job?id=999999").status, 404);
    assert_eq!(get(base, "/nowhere").status, 404);

    let token = csrf(&get(base, &format!("/job?id={dead}")).body);
    let act = |path: &str, fields: &[(&str, &str)]| {
        let mut all = vec![("csrf", token.as_str())];
        all.extend_from_slice(fields);
        post(base, path, &all)
    };

    // Retry one dead job, then the rest of its kind.
    let dead_text = dead.to_string();
    let retried = act("/job/retry", &[("id", &dead_text)]);
    assert_eq!(
        location(&retried),
        format!("/job?id={dead}&done=retried-one")
    );
    assert_eq!(state(&mut conn, dead), JobState::Waiting);
    assert!(
        get(base, location(&retried))
            .body
            .contains("the job waits again")
    );
    let again = act("/job/retry", &[("id", &dead_text)]);
    assert_eq!(location(&again), format!("/job?id={dead}&done=not-dead"));
    let all = act(
        "/queue/retry-dead",
        &[("name", "reports"), ("kind", "render")],
    );
    assert_eq!(location(&all), "/queue?name=reports&done=retried&n=1");
    assert_eq!(state(&mut conn, dead_too), JobState::Waiting);
    assert!(
        get(base, location(&all))
            .body
            .contains("Retried 1 dead job(s).")
    );

    // Cancel a waiting job.
    let cancelled = act("/job/cancel", &[("id", &waiting.to_string())]);
    assert_eq!(
        location(&cancelled),
        format!("/job?id={waiting}&done=cancelled")
    );
    assert_eq!(state(&mut conn, waiting), JobState::Cancelled);

    // Pause and resume a queue.
    location(&act("/queue/pause", &[("name", "mail")]));
    assert!(jobs::is_paused(&mut conn, "mail").unwrap());
    assert!(get(base, "/").body.contains("paused"));
    location(&act("/queue/resume", &[("name", "mail")]));
    assert!(!jobs::is_paused(&mut conn, "mail").unwrap());

    // Pause and resume a schedule.
    let paused = |conn: &mut AnyConnection| {
        schedules::list(conn)
            .unwrap()
            .iter()
            .find(|s| s.name == "digest")
            .unwrap()
            .paused
    };
    assert_eq!(
        location(&act("/schedule/pause", &[("name", "digest")])),
        "/schedules?done=schedule-paused"
    );
    assert!(paused(&mut conn));
    location(&act("/schedule/resume", &[("name", "digest")]));
    assert!(!paused(&mut conn));
    assert_eq!(
        location(&act("/schedule/pause", &[("name", "nope")])),
        "/schedules?done=no-schedule"
    );

    // A force-release needs its confirmation.
    let unconfirmed = act("/lease/release", &[("name", "nightly-backup")]);
    assert_eq!(unconfirmed.status, 400, "{}", unconfirmed.body);
    assert!(
        lease::inspect(&mut conn, "nightly-backup")
            .unwrap()
            .unwrap()
            .held
    );
    let released = act(
        "/lease/release",
        &[("name", "nightly-backup"), ("confirm", "yes")],
    );
    assert_eq!(location(&released), "/leases?done=released");
    assert!(
        !lease::inspect(&mut conn, "nightly-backup")
            .unwrap()
            .unwrap()
            .held
    );
    assert!(
        held.verify(&mut conn).is_err(),
        "the evicted holder learns it lost the lease"
    );
}

fn bad_input_gets_a_clear_error_and_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", vec![]))
        .unwrap()
        .id;
    let served = serve(db.url(), &[], &[]);
    let base = &served.base;
    let long = "x".repeat(tenure::MAX_NAME_BYTES + 1);
    let pages = [
        ("/job?id=abc".to_string(), "is not a job id"),
        ("/job?id=-4".to_string(), "is not a job id"),
        ("/job".to_string(), "is missing"),
        ("/jobs?state=bogus".to_string(), "is not a job state"),
        (
            "/jobs?before=99999999999999999999".to_string(),
            "is not a job id",
        ),
        (format!("/jobs?queue={long}"), "longer than"),
        (format!("/queue?name={long}"), "queue"),
        ("/queue".to_string(), "is missing"),
    ];
    for (path, says) in &pages {
        let answer = get(base, path);
        assert_eq!(answer.status, 400, "{path}: {}", answer.body);
        assert!(answer.body.contains(says), "{path}: {}", answer.body);
    }
    let token = csrf(&get(base, &format!("/job?id={id}")).body);
    let actions: [(&str, Vec<(&str, &str)>); 4] = [
        ("/job/cancel", vec![("id", "1e3")]),
        ("/queue/pause", vec![("name", &long)]),
        ("/queue/retry-dead", vec![("name", "q")]),
        ("/schedule/pause", vec![]),
    ];
    for (path, mut fields) in actions {
        fields.push(("csrf", &token));
        let answer = post(base, path, &fields);
        assert_eq!(answer.status, 400, "{path}: {}", answer.body);
    }
    assert_eq!(state(&mut conn, id), JobState::Waiting);
    assert!(!jobs::is_paused(&mut conn, &long).unwrap_or(false));
    // A form too large, or not a form, is refused before it is read.
    let big = "y".repeat(64 * 1024);
    let answer = post(
        base,
        "/job/cancel",
        &[("id", &id.to_string()), ("csrf", &token), ("pad", &big)],
    );
    assert_eq!(answer.status, 413);
    assert_eq!(state(&mut conn, id), JobState::Waiting);
}

fn stored_markup_is_shown_as_text(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let payload = format!("{{\"name\":\"{}\"}}", HOSTILE.replace('"', "\\\""));
    let id = dead_job(
        &mut conn,
        "<b>q</b>",
        "<i>kind</i>",
        payload.as_bytes(),
        HOSTILE,
    );
    lease::try_take(
        &mut conn,
        "<script>lease</script>",
        Duration::from_secs(60),
        HOSTILE,
    )
    .unwrap()
    .unwrap();
    let served = serve(db.url(), &[], &[]);
    for path in [
        "/".to_string(),
        "/jobs".to_string(),
        format!("/job?id={id}"),
        "/queue?name=%3Cb%3Eq%3C%2Fb%3E".to_string(),
        "/leases".to_string(),
        "/jobs?text=%3Cscript%3E".to_string(),
    ] {
        let page = get(&served.base, &path);
        assert_eq!(page.status, 200, "{path}");
        for raw in [
            "<script>window",
            "<img src=x",
            "<b>q</b>",
            "<i>kind",
            "<script>lease",
        ] {
            assert!(!page.body.contains(raw), "{path} holds {raw:?} unescaped");
        }
    }
    let job = get(&served.base, &format!("/job?id={id}")).body;
    assert!(
        job.contains("&lt;script&gt;window.__pwned=1&lt;/script&gt;"),
        "{job}"
    );
    // A large payload is shown in part: the page stays small, a character cut in two is
    // left out rather than shown as bytes.
    let big = format!("{{\"text\":\"{}\"}}", "é".repeat(60_000));
    let big_id = jobs::enqueue(&mut conn, &NewJob::new("q", "k", big.into_bytes()))
        .unwrap()
        .id;
    let page = get(&served.base, &format!("/job?id={big_id}"));
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("The first 65,536 of 120,011 bytes."),
        "{}",
        page.body.chars().take(3000).collect::<String>()
    );
    assert!(page.body.len() < 100_000, "{} bytes", page.body.len());
    assert!(page.body.contains("{&quot;text&quot;:&quot;éé"));
    assert!(job.contains("&lt;img src=x onerror="), "{job}");
}

fn the_jobs_list_pages_by_id_and_filters(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..120)
        .map(|i| {
            NewJob::new(if i % 2 == 0 { "even" } else { "odd" }, "k", vec![])
                .dedup_key(format!("key-{i}"))
        })
        .collect();
    let ids: Vec<i64> = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    jobs::enqueue(
        &mut conn,
        &NewJob::new("odd", "k", vec![]).dedup_key("100%_done!"),
    )
    .unwrap();
    let served = serve(db.url(), &[], &[]);
    let shown = |body: &str| -> Vec<i64> {
        body.split("data-id=\"")
            .skip(1)
            .map(|rest| rest.split('"').next().unwrap().parse().unwrap())
            .collect()
    };
    let older = |body: &str| -> Option<String> {
        let at = body.find("id=\"older\" href=\"")? + "id=\"older\" href=\"".len();
        Some(body[at..].split('"').next()?.replace("&amp;", "&"))
    };
    // Every job once, newest first, 50 a page, by following "Older".
    let mut seen = Vec::new();
    let mut path = "/jobs?queue=even".to_string();
    loop {
        let page = get(&served.base, &path);
        assert_eq!(page.status, 200, "{path}");
        let ids = shown(&page.body);
        assert!(ids.len() <= 50);
        seen.extend(ids);
        match older(&page.body) {
            Some(next) => path = next,
            None => break,
        }
    }
    let mut even: Vec<i64> = ids.iter().step_by(2).copied().collect();
    even.reverse();
    assert_eq!(seen, even);
    // A page asked for past the newest job starts at the newest (it does not page through
    // ids no job has).
    let first = get(&served.base, "/jobs?queue=even");
    let past = get(
        &served.base,
        &format!("/jobs?queue=even&before={}", i64::MAX),
    );
    assert_eq!(shown(&past.body), shown(&first.body));
    // Text is matched literally: `%`, `_` and `!` are not wildcards.
    let found = shown(&get(&served.base, "/jobs?text=100%25_done%21").body);
    assert_eq!(found.len(), 1);
    assert!(shown(&get(&served.base, "/jobs?text=1_0").body).is_empty());
    assert_eq!(
        shown(&get(&served.base, "/jobs?text=key-11&queue=odd").body).len(),
        6
    );
}

/// SIGTERM (or Ctrl-C) stops the server: its blocking accept is woken, it exits 0, and
/// the port is free again.
#[test]
fn sigterm_stops_the_server() {
    let db = TestDb::migrated(Backend::Sqlite);
    for listen in ["127.0.0.1:0", "0.0.0.0:0"] {
        let env: &[(&str, &str)] = if listen.starts_with("0.0.0.0") {
            &[("TENURE_SERVE_TOKEN", "a-long-enough-token-0123")]
        } else {
            &[]
        };
        let mut served = serve(db.url(), &["--listen", listen], env);
        let status = served
            .terminate()
            .expect("tenure serve exits after SIGTERM");
        assert!(status.success(), "{listen}: {status:?}\n{}", served.log());
    }
}

//! Claims of some kinds (`jobs::claim_kinds`): other kinds are never claimed nor changed, the
//! queue's order holds across the kinds given, bad input changes nothing, the kind index
//! serves the pick; and what a claim reports of its times.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as Clock};

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobState, NewJob, Outcome};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, conformance, contest, count, now_sql};

conformance!(
    a_kinds_claimer_never_claims_or_changes_other_kinds,
    claims_of_several_kinds_follow_the_queue_order,
    bad_kinds_are_refused_and_change_nothing,
    a_claim_of_one_kind_reads_the_kind_index_past_other_kinds,
    a_claim_reports_when_the_job_was_enqueued_and_claimed,
    overlapping_kind_sets_race_without_double_claims_or_strangers,
    a_limit_key_shared_by_kinds_holds_across_kinds_and_claimers,
    odd_kind_names_match_exactly,
);

const TTL: Duration = Duration::from_secs(60);

/// 8 threads claim kind A (in batches, completing each) until A is drained, while as many
/// jobs of kind B wait, interleaved with A's and some ahead of them: every A job completed
/// exactly once, every B job untouched (waiting, attempt 0, never claimed).
fn a_kinds_claimer_never_claims_or_changes_other_kinds(backend: Backend) {
    const PER_KIND: usize = 400;
    const THREADS: usize = 8;
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let (mut batch, mut kinds) = (Vec::new(), Vec::new());
    for i in 0..PER_KIND {
        // B ahead of A by priority for half of them, so a claim of any kind would take B.
        let b_priority = if i % 2 == 0 { -1 } else { 1 };
        batch.push(NewJob::new("mixed", "B", vec![]).priority(b_priority));
        batch.push(NewJob::new("mixed", "A", vec![]));
        kinds.extend(["B", "A"]);
    }
    let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
    let kind_of: HashMap<i64, &str> = ids.iter().map(|e| e.id).zip(kinds).collect();
    let done = Arc::new(AtomicUsize::new(0));
    let completions: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let claimed_kinds: Arc<Mutex<Vec<String>>> = Arc::default();
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let mut conn = db.connect();
            let (done, completions, claimed_kinds) =
                (done.clone(), completions.clone(), claimed_kinds.clone());
            std::thread::spawn(move || {
                let give_up = Clock::now() + Duration::from_secs(60);
                while done.load(Ordering::SeqCst) < PER_KIND && Clock::now() < give_up {
                    let jobs = jobs::claim_kinds(&mut conn, "mixed", &["A"], 7, TTL)
                        .expect("claim_kinds must not fail");
                    if jobs.is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    claimed_kinds
                        .lock()
                        .unwrap()
                        .extend(jobs.iter().map(|j| j.kind.clone()));
                    let claims: Vec<_> = jobs.iter().map(|j| j.claim()).collect();
                    let outcomes = jobs::complete(&mut conn, &claims).expect("complete");
                    let mut map = completions.lock().unwrap();
                    for (job, outcome) in jobs.iter().zip(outcomes) {
                        if outcome == Outcome::Done {
                            *map.entry(job.id).or_default() += 1;
                            done.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("a claimer panicked");
    }
    let claimed_kinds = claimed_kinds.lock().unwrap();
    assert!(
        claimed_kinds.iter().all(|k| k == "A"),
        "a claim of kind A handed out another kind"
    );
    let map = completions.lock().unwrap();
    for (id, kind) in &kind_of {
        let job = jobs::get(&mut conn, *id).unwrap().expect("the job exists");
        if *kind == "A" {
            assert_eq!(map.get(id), Some(&1), "job {id} completions");
            assert_eq!(job.state, JobState::Completed, "job {id}");
            assert_eq!(job.attempt, 1, "job {id}");
        } else {
            assert_eq!(map.get(id), None, "B job {id} was completed");
            assert_eq!(job.state, JobState::Waiting, "B job {id}");
            assert_eq!(job.attempt, 0, "B job {id}");
            assert_eq!(job.claimed_at, None, "B job {id} was claimed");
        }
    }
    assert_eq!(map.len(), PER_KIND);
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM tenure_jobs WHERE kind = 'A' AND state = 'completed'"
        ),
        PER_KIND as i64
    );
    // And B is still all there for a claimer of B.
    let b = jobs::claim_kinds(&mut conn, "mixed", &["B"], 1000, TTL).unwrap();
    assert_eq!(b.len(), PER_KIND);
}

/// Jobs of kinds A, C (claimed) and B (not), with priorities and due times that interleave:
/// a claim of [C, A] takes A's and C's by priority, then due time, then id, never a B.
fn claims_of_several_kinds_follow_the_queue_order(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // (kind, priority, due in the past by this many seconds)
    let spec: &[(&str, i32, i64)] = &[
        ("A", 5, 10),
        ("B", 0, 50),
        ("C", 5, 20),
        ("A", 0, 1),
        ("C", 0, 30),
        ("B", -5, 60),
        ("A", 5, 10),
        ("C", -1, 0),
        ("A", 9, 40),
        ("B", 1, 5),
        ("C", 5, 10),
    ];
    let base = tenure::database_now(&mut conn).unwrap();
    let mut expected = Vec::new();
    for (kind, priority, ago) in spec {
        let at = base - chrono::Duration::seconds(*ago);
        let id = jobs::enqueue(
            &mut conn,
            &NewJob::new("order", *kind, vec![])
                .priority(*priority)
                .at(at),
        )
        .unwrap()
        .id;
        if *kind != "B" {
            expected.push((*priority, at, id));
        }
    }
    expected.sort();
    let expected: Vec<i64> = expected.into_iter().map(|e| e.2).collect();
    // A repeat in the list is harmless; three at a time, then the rest.
    let mut got = Vec::new();
    loop {
        let batch = jobs::claim_kinds(&mut conn, "order", &["C", "A", "C"], 3, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        assert!(batch.iter().all(|j| j.kind != "B"), "{batch:?}");
        got.extend(batch.iter().map(|j| j.id));
    }
    assert_eq!(got, expected);
    // Several kinds in one claim return the same order.
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut expected = Vec::new();
    for (kind, priority, ago) in spec {
        let at = base - chrono::Duration::seconds(*ago);
        let job = NewJob::new("order", *kind, vec![])
            .priority(*priority)
            .at(at);
        let id = jobs::enqueue(&mut conn, &job).unwrap().id;
        if *kind != "A" {
            expected.push((*priority, at, id));
        }
    }
    expected.sort();
    let got: Vec<i64> = jobs::claim_kinds(&mut conn, "order", &["B", "C"], 100, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(got, expected.into_iter().map(|e| e.2).collect::<Vec<_>>());
}

fn bad_kinds_are_refused_and_change_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("bad", "A", vec![]))
        .unwrap()
        .id;
    let too_many: Vec<String> = (0..=jobs::MAX_KINDS).map(|i| format!("k{i}")).collect();
    let long = "k".repeat(256);
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("empty list", vec![]),
        ("too many", too_many),
        ("empty name", vec!["A".into(), String::new()]),
        ("too long", vec![long, "A".into()]),
    ];
    for (what, kinds) in cases {
        match jobs::claim_kinds(&mut conn, "bad", &kinds, 10, TTL) {
            Err(Error::InvalidInput { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    let none: &[&str] = &[];
    assert!(matches!(
        jobs::claim_kinds(&mut conn, "bad", none, 10, TTL),
        Err(Error::InvalidInput { .. })
    ));
    // The other checks of a claim hold too.
    for result in [
        jobs::claim_kinds(&mut conn, "", &["A"], 10, TTL),
        jobs::claim_kinds(&mut conn, "bad", &["A"], 0, TTL),
        jobs::claim_kinds(&mut conn, "bad", &["A"], 10, Duration::ZERO),
    ] {
        assert!(
            matches!(result, Err(Error::InvalidInput { .. })),
            "{result:?}"
        );
    }
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Waiting, 0));
    assert_eq!(job.claimed_at, None);
    // Exactly 1000 kinds is fine (and finds the job).
    let mut many: Vec<String> = (1..jobs::MAX_KINDS).map(|i| format!("k{i}")).collect();
    many.push("A".into());
    assert_eq!(
        jobs::claim_kinds(&mut conn, "bad", &many, 10, TTL)
            .unwrap()
            .len(),
        1
    );
}

/// 10,000 waiting jobs of kind B ahead of 20 of kind A (by priority): the pick of a claim of
/// A reads the kind index, in order (no sort), so no B is read. The statement is the one
/// `claim_kinds` runs for one kind (its `IN` list of one).
fn a_claim_of_one_kind_reads_the_kind_index_past_other_kinds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
        UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
        UNION ALL SELECT 8 UNION ALL SELECT 9)";
    let now = now_sql(backend);
    let payload = match backend {
        Backend::Postgres => "'\\x00'::bytea",
        _ => "x'00'",
    };
    conn.batch_execute(&format!(
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at) \
         SELECT 'plan', 'B', {payload}, -1, 'waiting', 0, 1, {now}, {now} \
         FROM {digits} a, {digits} b, {digits} c, {digits} d"
    ))
    .unwrap();
    for _ in 0..20 {
        jobs::enqueue(&mut conn, &NewJob::new("plan", "A", vec![])).unwrap();
    }
    conn.batch_execute(match backend {
        Backend::Postgres => "ANALYZE tenure_jobs; ANALYZE tenure_ready",
        Backend::Mysql => "ANALYZE TABLE tenure_jobs, tenure_ready",
        Backend::Sqlite => "ANALYZE",
    })
    .unwrap();
    let (hint, skip_locked) = match backend {
        Backend::Sqlite => (" INDEXED BY tenure_jobs_claim_kind", ""),
        Backend::Mysql => (
            " FORCE INDEX (tenure_jobs_claim_kind)",
            " FOR UPDATE SKIP LOCKED",
        ),
        Backend::Postgres => ("", " FOR UPDATE SKIP LOCKED"),
    };
    let pick = format!(
        "SELECT id, limit_key, limit_max FROM tenure_jobs{hint} \
         WHERE queue = 'plan' AND state = 'waiting' AND due_at <= {now} AND kind IN ('A') \
           AND NOT EXISTS (SELECT 1 FROM tenure_queue_pauses p WHERE p.queue = 'plan') \
           AND (limit_key IS NULL OR limit_key NOT IN ( \
               SELECT r.limit_key FROM tenure_jobs r \
               WHERE r.state = 'running' AND r.limit_key IS NOT NULL \
               GROUP BY r.limit_key HAVING COUNT(*) >= MIN(r.limit_max))) \
         ORDER BY priority, fair_stamp, due_at, id LIMIT 10{skip_locked}"
    );
    // The servers' picks read the ready ring (CLAIM_PICK_KIND).
    let pick = match backend {
        // PostgreSQL's pick reads and locks the entries alone (the mark locks the jobs).
        Backend::Postgres => format!(
            "SELECT c.id, c.priority, c.fair_stamp, c.due_at, c.limit_key \
             FROM tenure_ready c \
             WHERE c.queue = 'plan' AND c.due_at <= {now} AND c.kind = 'A' \
             ORDER BY c.priority, c.fair_stamp, c.due_at, c.id LIMIT 10 FOR UPDATE SKIP LOCKED"
        ),
        Backend::Mysql => format!(
            "SELECT c.id, c.priority, c.fair_stamp, c.due_at, c.limit_key \
             FROM tenure_ready c FORCE INDEX (tenure_ready_claim_kind) \
             STRAIGHT_JOIN tenure_jobs j FORCE INDEX (PRIMARY) ON j.id = c.id \
             WHERE c.queue = 'plan' AND j.state = 'waiting' AND c.due_at <= {now} \
             AND c.kind = 'A' ORDER BY c.priority, c.fair_stamp, c.due_at, c.id LIMIT 10 FOR UPDATE SKIP LOCKED"
        ),
        Backend::Sqlite => pick,
    };
    let plan = crate::jobs::explain(&mut conn, &pick);
    println!("{backend} claim-of-one-kind plan behind 10,000 other jobs:\n{plan}");
    match backend {
        Backend::Postgres => {
            // Each slot's kind index, merged in order.
            assert!(
                plan.contains("queue_kind_priority_fair_stamp_due_at_id_idx"),
                "{plan}"
            );
            // No job is read: the entries carry what the pick filters and orders by.
            assert!(!plan.contains("on tenure_jobs"), "{plan}");
            assert!(plan.contains("kind = 'A'"), "{plan}");
            // Merged in order (a Merge Append's sort key), never sorted.
            assert!(!plan.contains("Sort  ("), "{plan}");
        }
        Backend::Mysql => {
            // The ring's kind index, then each job by its primary key.
            assert!(
                plan.contains("\"key\": \"tenure_ready_claim_kind\""),
                "{plan}"
            );
            assert!(plan.contains("\"key\": \"PRIMARY\""), "{plan}");
            assert!(!plan.contains("filesort"), "{plan}");
        }
        Backend::Sqlite => {
            assert!(
                plan.contains("INDEX tenure_jobs_claim_kind (queue=? AND kind=?"),
                "{plan}"
            );
            assert!(!plan.contains("TEMP B-TREE"), "{plan}");
        }
    }
    let claimed = jobs::claim_kinds(&mut conn, "plan", &["A"], 100, TTL).unwrap();
    assert_eq!(claimed.len(), 20);
    assert!(claimed.iter().all(|j| j.kind == "A"));
}

/// A claim reads back when the job was enqueued and when it was claimed, as stored
/// (database clock), and the claim's expiry is its claim time plus the ttl.
fn a_claim_reports_when_the_job_was_enqueued_and_claimed(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn: AnyConnection = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("times", "A", vec![]))
        .unwrap()
        .id;
    let before = tenure::database_now(&mut conn).unwrap();
    let check = |conn: &mut AnyConnection, job: &jobs::ClaimedJob| {
        let stored = jobs::get(conn, id).unwrap().unwrap();
        assert_eq!(job.created_at, stored.created_at);
        assert_eq!(Some(job.claimed_at), stored.claimed_at);
        assert_eq!(job.due_at, stored.due_at);
        assert!(job.created_at <= job.claimed_at, "{job:?}");
        assert!(job.claimed_at >= before, "{job:?} claimed before {before}");
        let ttl = job.claim_expires_at - job.claimed_at;
        let off = ttl - chrono::Duration::from_std(TTL).unwrap();
        assert!(off.num_milliseconds().abs() <= 1, "{job:?}");
    };
    let first = jobs::claim(&mut conn, "times", 1, TTL).unwrap().remove(0);
    check(&mut conn, &first);
    assert_eq!(
        jobs::give_back(&mut conn, &[first.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    std::thread::sleep(Duration::from_millis(5));
    let second = jobs::claim_kinds(&mut conn, "times", &["A"], 1, TTL)
        .unwrap()
        .remove(0);
    check(&mut conn, &second);
    assert!(second.claimed_at > first.claimed_at);
    assert_eq!(second.created_at, first.created_at);
}

/// Six claimers with overlapping kind sets race on one queue of five kinds (one of which no
/// claimer takes): every job of a taken kind is claimed exactly once, by a claimer of its
/// kind, each claim in queue order; the other kind is untouched.
fn overlapping_kind_sets_race_without_double_claims_or_strangers(backend: Backend) {
    const SETS: [&[&str]; 6] = [
        &["a", "b"],
        &["b", "c"],
        &["c", "a"],
        &["a"],
        &["b", "c", "d", "b"],
        &["d"],
    ];
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let kinds = ["a", "b", "c", "d", "e"];
    let mut by_kind: HashMap<i64, &str> = HashMap::new();
    for i in 0..250 {
        let kind = kinds[i % kinds.len()];
        let job = NewJob::new("ov", kind, vec![]).priority((i * 7 % 5) as i32);
        by_kind.insert(jobs::enqueue(&mut conn, &job).unwrap().id, kind);
    }
    let claimed: Arc<Mutex<Vec<(usize, i64)>>> = Arc::default();
    let sink = claimed.clone();
    contest(
        &db,
        SETS.len(),
        60,
        move |_, i, conn| {
            let got = jobs::claim_kinds(conn, "ov", SETS[i], 3, Duration::from_secs(600))
                .unwrap_or_else(|e| panic!("claimer {i}: {e}"));
            let keys: Vec<_> = got.iter().map(|j| (j.priority, j.due_at, j.id)).collect();
            let mut sorted = keys.clone();
            sorted.sort();
            assert_eq!(keys, sorted, "a claim out of order");
            let mut sink = sink.lock().unwrap();
            for job in got {
                assert!(SETS[i].contains(&job.kind.as_str()), "{job:?} by {i}");
                sink.push((i, job.id));
            }
        },
        |_, _| {},
    );
    let claimed = claimed.lock().unwrap();
    let mut once = HashSet::new();
    for (i, id) in claimed.iter() {
        assert!(once.insert(*id), "job {id} claimed twice (last by {i})");
    }
    for (id, kind) in &by_kind {
        let job = jobs::get(&mut conn, *id).unwrap().unwrap();
        if *kind == "e" {
            assert_eq!((job.state, job.attempt), (JobState::Waiting, 0), "{job:?}");
        } else {
            assert!(once.contains(id), "{job:?} never claimed");
            assert_eq!(job.state, JobState::Running, "{job:?}");
        }
    }
}

/// Jobs of three kinds share one limit key (at most 2 running). Claimers of one kind each
/// and one of all three race, many rounds: never more than 2 running; between rounds the
/// judge completes what runs.
fn a_limit_key_shared_by_kinds_holds_across_kinds_and_claimers(backend: Backend) {
    const SETS: [&[&str]; 4] = [&["x"], &["y"], &["z"], &["x", "y", "z"]];
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for i in 0..120 {
        let kind = ["x", "y", "z"][i % 3];
        jobs::enqueue(
            &mut conn,
            &NewJob::new("lk", kind, vec![]).limit("shared", 2),
        )
        .unwrap();
    }
    // One claim of all three kinds takes at most 2.
    let first = jobs::claim_kinds(
        &mut conn,
        "lk",
        &["x", "y", "z"],
        10,
        Duration::from_secs(600),
    )
    .unwrap();
    assert_eq!(first.len(), 2, "{first:?}");
    let claims: Vec<_> = first.iter().map(|j| j.claim()).collect();
    jobs::complete(&mut conn, &claims).unwrap();
    let held: Arc<Mutex<Vec<jobs::JobClaim>>> = Arc::default();
    let sink = held.clone();
    let mut judge_conn = db.connect();
    contest(
        &db,
        SETS.len(),
        40,
        move |_, i, conn| {
            let got = jobs::claim_kinds(conn, "lk", SETS[i], 5, Duration::from_secs(600))
                .unwrap_or_else(|e| panic!("claimer {i}: {e}"));
            sink.lock().unwrap().extend(got.iter().map(|j| j.claim()));
            got.len()
        },
        move |round, got| {
            let mut held = held.lock().unwrap();
            assert!(held.len() <= 2, "round {round}: {got:?} claimed, limit 2");
            if !held.is_empty() {
                jobs::complete(&mut judge_conn, &held).unwrap();
            }
            held.clear();
        },
    );
}

/// Kinds that differ by case, a trailing space, an accent, LIKE wildcards, quotes or
/// backslashes are different kinds; a 255-byte kind and 100 kinds in one claim work; a
/// repeated kind is harmless; 101 kinds are refused.
fn odd_kind_names_match_exactly(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let long = "é".repeat(127) + "z";
    let names: Vec<String> = vec![
        "a".into(),
        "A".into(),
        "a ".into(),
        " a".into(),
        "á".into(),
        "a%".into(),
        "_".into(),
        "'a'".into(),
        "\"a\"".into(),
        "a\\".into(),
        "a'); DELETE FROM tenure_jobs; --".into(),
        "日本".into(),
        long.clone(),
        "k".repeat(255),
    ];
    let mut ids = HashMap::new();
    for name in &names {
        let id = jobs::enqueue(&mut conn, &NewJob::new("odd", name.as_str(), vec![]))
            .unwrap()
            .id;
        ids.insert(name.clone(), id);
    }
    for name in &names {
        let got = jobs::claim_kinds(
            &mut conn,
            "odd",
            &[name.as_str(), name.as_str()],
            10,
            Duration::from_secs(600),
        )
        .unwrap();
        let got: Vec<i64> = got.iter().map(|j| j.id).collect();
        assert_eq!(got, vec![ids[name]], "kind {name:?}");
    }
    let mut many: Vec<String> = (0..99).map(|i| format!("none-{i}")).collect();
    many.push("later".into());
    let later = jobs::enqueue(&mut conn, &NewJob::new("odd", "later", vec![]))
        .unwrap()
        .id;
    let got = jobs::claim_kinds(&mut conn, "odd", &many, 10, Duration::from_secs(600)).unwrap();
    assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![later]);
    many.push("one-too-many".into());
    let refused = jobs::claim_kinds(&mut conn, "odd", &many, 10, Duration::from_secs(600));
    assert!(refused.unwrap_err().is_invalid_input());
    // A paused queue gives nothing to a kinds claim either.
    jobs::enqueue(&mut conn, &NewJob::new("odd", "a", vec![])).unwrap();
    jobs::pause(&mut conn, "odd").unwrap();
    let paused = jobs::claim_kinds(&mut conn, "odd", &["a"], 10, Duration::from_secs(600));
    assert!(paused.unwrap().is_empty());
}

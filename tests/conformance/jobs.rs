//! The job queue core: enqueue, claim, finish, retries, give-backs, delays and priorities, bad
//! input, on every backend (claims and rescues under concurrency: `claim_races.rs`).

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::Text;
use tenure::jobs::{self, Backoff, JobClaim, JobState, NewJob, Outcome, Retry};
use tenure::{AnyConnection, Backend, Error, TenureConnection};

use crate::common::{TestDb, conformance, count, now_sql, wait_for_db_clock};

conformance!(
    failed_runs_retry_then_die,
    backoff_delays_a_retry,
    give_back_and_stalls_keep_the_attempt,
    delays_priorities_and_queues,
    complete_in_a_rolled_back_transaction_changes_nothing,
    enqueue_in_a_rolled_back_transaction_leaves_no_job,
    bad_input_is_refused_and_writes_nothing,
    payloads_round_trip_byte_for_byte,
    claim_is_served_by_an_index_with_many_finished_jobs,
);

const TTL: Duration = Duration::from_secs(60);

fn state_of(conn: &mut AnyConnection, id: i64) -> JobState {
    jobs::get(conn, id).unwrap().expect("the job exists").state
}

fn failed_runs_retry_then_die(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("r", "k", vec![]).max_attempts(3))
        .unwrap()
        .id;
    for attempt in 1..=3 {
        let job = jobs::claim(&mut conn, "r", 1, TTL).unwrap().remove(0);
        assert_eq!(job.attempt, attempt);
        let outcome = jobs::fail(
            &mut conn,
            job.claim(),
            &format!("boom {attempt}"),
            Retry::After(Duration::ZERO),
        )
        .unwrap();
        assert_eq!(outcome, Outcome::Done);
        // Repeating the call is recognised.
        assert_eq!(
            jobs::fail(&mut conn, job.claim(), "again", Retry::Never).unwrap(),
            Outcome::AlreadyDone
        );
    }
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!((job.state, job.attempt), (JobState::Dead, 3));
    assert_eq!(job.last_error.as_deref(), Some("boom 3"));
    assert!(job.finished_at.is_some());
    assert!(jobs::claim(&mut conn, "r", 1, TTL).unwrap().is_empty());

    // A handler can ask for no retry: dead at once, attempts left or not.
    let id = jobs::enqueue(&mut conn, &NewJob::new("r", "k", vec![]))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "r", 1, TTL).unwrap().remove(0);
    let long_error = "é".repeat(5000);
    jobs::fail(&mut conn, job.claim(), &long_error, Retry::Never).unwrap();
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!(job.state, JobState::Dead);
    let kept = job.last_error.unwrap();
    assert!(kept.len() <= jobs::MAX_ERROR_BYTES && long_error.starts_with(&kept));

    // Or for a retry at a given time.
    let id = jobs::enqueue(&mut conn, &NewJob::new("r", "k", vec![]))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "r", 1, TTL).unwrap().remove(0);
    // Seconds ahead, not milliseconds: at load 10 the next statement came 300 ms later.
    let at = tenure::database_now(&mut conn).unwrap() + chrono::Duration::seconds(5);
    jobs::fail(&mut conn, job.claim(), "later", Retry::At(at)).unwrap();
    assert!(jobs::claim(&mut conn, "r", 1, TTL).unwrap().is_empty());
    wait_for_db_clock(&mut conn, at);
    let again = jobs::claim(&mut conn, "r", 1, TTL).unwrap();
    assert_eq!(again.first().map(|j| (j.id, j.attempt)), Some((id, 2)));
}

fn backoff_delays_a_retry(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("b", "k", vec![]))
        .unwrap()
        .id;
    let backoff = Backoff {
        base: Duration::from_secs(2),
        max: Duration::from_secs(60),
    };
    assert_eq!(backoff.delay(1), Duration::from_secs(2));
    assert_eq!(backoff.delay(3), Duration::from_secs(8));
    assert_eq!(backoff.delay(30), Duration::from_secs(60));
    for attempt in 1..=2u32 {
        let job = jobs::claim(&mut conn, "b", 1, TTL).unwrap().remove(0);
        let before = tenure::database_now(&mut conn).unwrap();
        jobs::fail(&mut conn, job.claim(), "x", Retry::Backoff(backoff)).unwrap();
        let after = tenure::database_now(&mut conn).unwrap();
        let due = jobs::get(&mut conn, id).unwrap().unwrap().due_at;
        let full = chrono::Duration::from_std(backoff.delay(attempt)).unwrap();
        // Jitter keeps between half and all of the delay.
        assert!(
            due >= before + full / 2 - chrono::Duration::milliseconds(2),
            "attempt {attempt}: {due} vs {before}"
        );
        assert!(due <= after + full, "attempt {attempt}: {due} vs {after}");
        assert!(jobs::claim(&mut conn, "b", 1, TTL).unwrap().is_empty());
        // Make it due now to go on.
        diesel::sql_query(format!(
            "UPDATE tenure_jobs SET due_at = {} WHERE id = {id}",
            now_sql(backend)
        ))
        .execute(&mut conn)
        .unwrap();
    }
}

fn give_back_and_stalls_keep_the_attempt(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("g", "k", vec![]).max_attempts(2))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "g", 1, TTL).unwrap().remove(0);
    assert_eq!(
        jobs::give_back(&mut conn, &[job.claim()]).unwrap(),
        vec![Outcome::Done]
    );
    assert_eq!(
        jobs::give_back(&mut conn, &[job.claim()]).unwrap(),
        vec![Outcome::AlreadyDone]
    );
    let job = jobs::claim(&mut conn, "g", 1, TTL).unwrap().remove(0);
    assert_eq!(job.attempt, 1, "give back does not use an attempt");
    jobs::give_back(&mut conn, &[job.claim()]).unwrap();

    // A stalled claim uses no attempt either (the worker may have died before the run
    // began); it counts a lapse, and a job is dead at MAX_LAPSES of them
    // (worker::runs::a_job_whose_claims_keep_lapsing_ends_dead).
    let ttl = Duration::from_millis(100);
    let first = jobs::claim(&mut conn, "g", 1, ttl).unwrap().remove(0);
    assert_eq!(first.attempt, 1);
    std::thread::sleep(ttl * 2);
    assert_eq!(jobs::rescue(&mut conn, 10).unwrap().requeued, vec![id]);
    let second = jobs::claim(&mut conn, "g", 1, TTL).unwrap().remove(0);
    assert_eq!(second.attempt, 1);
    jobs::complete(&mut conn, &[second.claim()]).unwrap();
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!((job.state, job.lapses), (JobState::Completed, 1));
    // A rescue never overwrites a finished job.
    assert!(jobs::rescue(&mut conn, 10).unwrap().dead.is_empty());
}

fn delays_priorities_and_queues(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // Delays of seconds, and waits on the database's clock: at load 10 a 400 ms delay had
    // passed before the next statement ran.
    let delay = Duration::from_secs(5);
    let late = jobs::enqueue(&mut conn, &NewJob::new("d", "k", vec![]).delay(delay))
        .unwrap()
        .id;
    assert!(
        jobs::claim(&mut conn, "d", 10, TTL).unwrap().is_empty(),
        "claimed before its due time"
    );
    let due = jobs::get(&mut conn, late).unwrap().unwrap().due_at;
    wait_for_db_clock(&mut conn, due);
    assert_eq!(jobs::claim(&mut conn, "d", 10, TTL).unwrap()[0].id, late);
    // The same in one batch: each job keeps its own due time.
    let at = tenure::database_now(&mut conn).unwrap() + chrono::Duration::seconds(5);
    let batch = [
        NewJob::new("d", "k", b"later".to_vec()).at(at),
        NewJob::new("d", "k", b"now".to_vec()),
        NewJob::new("d", "k", b"delayed".to_vec()).delay(delay),
    ];
    let ids = jobs::enqueue_many(&mut conn, &batch)
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect::<Vec<i64>>();
    let now: Vec<i64> = jobs::claim(&mut conn, "d", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(now, vec![ids[1]]);
    let delayed_due = jobs::get(&mut conn, ids[2]).unwrap().unwrap().due_at;
    wait_for_db_clock(&mut conn, delayed_due.max(at));
    let later: Vec<Vec<u8>> = jobs::claim(&mut conn, "d", 10, TTL)
        .unwrap()
        .into_iter()
        .map(|j| j.payload)
        .collect();
    assert_eq!(later, vec![b"later".to_vec(), b"delayed".to_vec()]);

    let low = jobs::enqueue(&mut conn, &NewJob::new("p", "k", vec![]).priority(5))
        .unwrap()
        .id;
    let high = jobs::enqueue(&mut conn, &NewJob::new("p", "k", vec![]).priority(-1))
        .unwrap()
        .id;
    let mid1 = jobs::enqueue(&mut conn, &NewJob::new("p", "k", vec![]))
        .unwrap()
        .id;
    let mid2 = jobs::enqueue(&mut conn, &NewJob::new("p", "k", vec![]))
        .unwrap()
        .id;
    let other = jobs::enqueue(&mut conn, &NewJob::new("other", "k", vec![]).priority(-100))
        .unwrap()
        .id;
    assert_eq!(jobs::claim(&mut conn, "p", 1, TTL).unwrap()[0].id, high);
    let rest: Vec<i64> = jobs::claim(&mut conn, "p", 10, TTL)
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(rest, vec![mid1, mid2, low]);
    assert!(
        jobs::claim(&mut conn, "P", 10, TTL).unwrap().is_empty(),
        "queue names are byte-exact"
    );
    assert_eq!(
        jobs::claim(&mut conn, "other", 10, TTL).unwrap()[0].id,
        other
    );
}

fn complete_in_a_rolled_back_transaction_changes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute("CREATE TABLE effects (id INTEGER PRIMARY KEY)")
        .unwrap();
    let id = jobs::enqueue(&mut conn, &NewJob::new("t", "k", vec![]))
        .unwrap()
        .id;
    let job = jobs::claim(&mut conn, "t", 1, TTL).unwrap().remove(0);
    let rolled_back: Result<(), Error> = tenure::transaction(&mut conn, |c| {
        c.batch_execute("INSERT INTO effects (id) VALUES (1)")?;
        assert_eq!(jobs::complete(c, &[job.claim()])?, vec![Outcome::Done]);
        Err(Error::Timeout {
            what: "the handler's own failure",
        })
    });
    assert!(rolled_back.is_err());
    assert_eq!(state_of(&mut conn, id), JobState::Running, "still claimed");
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM effects"),
        0,
        "the writes are gone"
    );
    let committed = tenure::transaction(&mut conn, |c| {
        c.batch_execute("INSERT INTO effects (id) VALUES (1)")?;
        jobs::complete(c, &[job.claim()])
    })
    .unwrap();
    assert_eq!(committed, vec![Outcome::Done]);
    assert_eq!(state_of(&mut conn, id), JobState::Completed);
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM effects"), 1);
}

fn enqueue_in_a_rolled_back_transaction_leaves_no_job(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let outcome: Result<(), Error> = conn.transaction(|c| {
        jobs::enqueue(c, &NewJob::new("tx", "k", vec![]))?;
        jobs::enqueue_many(
            c,
            &[
                NewJob::new("tx", "k", vec![]),
                NewJob::new("tx", "k", vec![]),
            ],
        )?;
        Err(Error::Timeout { what: "a rollback" })
    });
    assert!(outcome.is_err());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    conn.transaction(|c| jobs::enqueue(c, &NewJob::new("tx", "k", vec![])))
        .unwrap();
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 1);
}

fn bad_input_is_refused_and_writes_nothing(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let bad = vec![
        ("empty queue", NewJob::new("", "k", vec![])),
        ("long queue", NewJob::new("q".repeat(256), "k", vec![])),
        ("empty kind", NewJob::new("q", "", vec![])),
        ("NUL in kind", NewJob::new("q", "k\0", vec![])),
        (
            "zero attempts",
            NewJob::new("q", "k", vec![]).max_attempts(0),
        ),
        (
            "huge attempts",
            NewJob::new("q", "k", vec![]).max_attempts(1001),
        ),
        (
            "oversize payload",
            NewJob::new("q", "k", vec![0u8; jobs::MAX_PAYLOAD_BYTES + 1]),
        ),
        (
            "absurd delay",
            NewJob::new("q", "k", vec![]).delay(Duration::from_secs(400 * 86400)),
        ),
    ];
    for (what, job) in &bad {
        assert!(
            jobs::enqueue(&mut conn, job)
                .unwrap_err()
                .is_invalid_input(),
            "{what}"
        );
        let mixed = vec![NewJob::new("q", "k", vec![]), job.clone()];
        assert!(
            jobs::enqueue_many(&mut conn, &mixed)
                .unwrap_err()
                .is_invalid_input(),
            "{what} in a batch"
        );
    }
    assert!(
        jobs::enqueue_many(&mut conn, &[])
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::claim(&mut conn, "q", 0, TTL)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::claim(&mut conn, "q", 1001, TTL)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::claim(&mut conn, "q", 1, Duration::ZERO)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::claim(&mut conn, "", 1, TTL)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::complete(&mut conn, &[])
            .unwrap_err()
            .is_invalid_input()
    );
    let claim = JobClaim {
        id: 1,
        token: uuid::Uuid::new_v4(),
    };
    assert!(
        jobs::complete(&mut conn, &[claim, claim])
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        jobs::renew(&mut conn, &[claim], Duration::ZERO)
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(jobs::rescue(&mut conn, 0).unwrap_err().is_invalid_input());
    assert_eq!(count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"), 0);
    // Claiming needs a bare connection.
    let refused = conn
        .transaction(|c| jobs::claim(c, "q", 1, TTL))
        .unwrap_err();
    assert!(
        matches!(refused, Error::InTransaction { .. }),
        "{refused:?}"
    );
}

fn payloads_round_trip_byte_for_byte(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut big = vec![0u8; 1 << 20];
    for (i, b) in big.iter_mut().enumerate() {
        *b = (i * 7919 % 251) as u8;
    }
    let payloads: Vec<Vec<u8>> = vec![
        vec![],
        b"\0\0nul\0".to_vec(),
        b"it's \"quoted\" \\ ; DROP TABLE tenure_jobs; --".to_vec(),
        vec![0xff, 0xfe, 0x80, 0xc3, 0x28],
        big,
    ];
    for payload in &payloads {
        jobs::enqueue(&mut conn, &NewJob::new("bytes", "k", payload.clone())).unwrap();
    }
    let claimed = jobs::claim(&mut conn, "bytes", 10, TTL).unwrap();
    let got: Vec<Vec<u8>> = claimed.iter().map(|j| j.payload.clone()).collect();
    assert_eq!(got, payloads);
    let typed = NewJob::json("bytes", "json", &serde_json::json!({"n": 1, "s": "ü"})).unwrap();
    let id = jobs::enqueue(&mut conn, &typed).unwrap().id;
    let job = jobs::claim(&mut conn, "bytes", 1, TTL).unwrap().remove(0);
    assert_eq!(job.id, id);
    let value: serde_json::Value = job.json().unwrap();
    assert_eq!(value["s"], "ü");
    assert!(job.json::<Vec<u8>>().unwrap_err().is_invalid_input());
}

/// With 100,000 finished jobs in the table, the claim's plan still reads an index (and, on
/// MySQL, in order: no filesort, so InnoDB locks only what it returns).
fn claim_is_served_by_an_index_with_many_finished_jobs(backend: Backend) {
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
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, due_at, created_at, finished_at) \
         SELECT 'plan', 'k', {payload}, 0, 'completed', 1, 1, {now}, {now}, {now} \
         FROM {digits} a, {digits} b, {digits} c, {digits} d, {digits} e"
    ))
    .unwrap();
    for _ in 0..20 {
        jobs::enqueue(&mut conn, &NewJob::new("plan", "k", vec![])).unwrap();
    }
    conn.batch_execute(match backend {
        Backend::Postgres => "ANALYZE tenure_jobs; ANALYZE tenure_ready",
        Backend::Mysql => "ANALYZE TABLE tenure_jobs, tenure_ready",
        Backend::Sqlite => "ANALYZE",
    })
    .unwrap();
    // The statement the claim runs to pick its jobs (CLAIM_PICK): the servers' read the
    // ready ring, which finished jobs never enter.
    let skip_locked = if backend == Backend::Sqlite {
        ""
    } else {
        " FOR UPDATE SKIP LOCKED"
    };
    let hint = match backend {
        Backend::Sqlite => " INDEXED BY tenure_jobs_claim",
        Backend::Mysql => " FORCE INDEX (tenure_jobs_claim)",
        Backend::Postgres => "",
    };
    let pick = format!(
        "SELECT id, limit_key, limit_max FROM tenure_jobs{hint} \
         WHERE queue = 'plan' AND state = 'waiting' AND due_at <= {now} \
           AND NOT EXISTS (SELECT 1 FROM tenure_queue_pauses p WHERE p.queue = 'plan') \
           AND (limit_key IS NULL OR limit_key NOT IN ( \
               SELECT r.limit_key FROM tenure_jobs r \
               WHERE r.state = 'running' AND r.limit_key IS NOT NULL \
               GROUP BY r.limit_key HAVING COUNT(*) >= MIN(r.limit_max))) \
         ORDER BY priority, fair_stamp, due_at, id LIMIT 10{skip_locked}"
    );
    let pick = match backend {
        // PostgreSQL's pick reads and locks the entries alone (the mark locks the jobs).
        Backend::Postgres => format!(
            "SELECT c.id, c.priority, c.fair_stamp, c.due_at, c.limit_key \
             FROM tenure_ready c \
             WHERE c.queue = 'plan' AND c.due_at <= {now} \
             ORDER BY c.priority, c.fair_stamp, c.due_at, c.id LIMIT 10 FOR UPDATE SKIP LOCKED"
        ),
        Backend::Mysql => format!(
            "SELECT c.id, c.priority, c.fair_stamp, c.due_at, c.limit_key \
             FROM tenure_ready c FORCE INDEX (tenure_ready_claim) \
             STRAIGHT_JOIN tenure_jobs j FORCE INDEX (PRIMARY) ON j.id = c.id \
             WHERE c.queue = 'plan' AND j.state = 'waiting' AND c.due_at <= {now} \
             ORDER BY c.priority, c.fair_stamp, c.due_at, c.id LIMIT 10 FOR UPDATE SKIP LOCKED"
        ),
        Backend::Sqlite => pick,
    };
    let plan = explain(&mut conn, &pick);
    println!("{backend} claim plan with 100,000 finished jobs:\n{plan}");
    match backend {
        Backend::Postgres => {
            // The ring, which no finished job enters (20 entries: the planner may read them
            // whole).
            assert!(plan.contains("on tenure_ready_0"), "{plan}");
            // No job is read: the entries carry what the pick filters and orders by (the
            // mark reads the admitted jobs by id, in their slots).
            assert!(!plan.contains("on tenure_jobs"), "{plan}");
        }
        Backend::Mysql => {
            // The ring's claim index, then each job by its primary key.
            assert!(plan.contains("\"key\": \"tenure_ready_claim\""), "{plan}");
            assert!(plan.contains("\"key\": \"PRIMARY\""), "{plan}");
            assert!(!plan.contains("filesort"), "{plan}");
        }
        Backend::Sqlite => {
            assert!(plan.contains("INDEX tenure_jobs_claim"), "{plan}");
            assert!(!plan.contains("TEMP B-TREE"), "{plan}");
        }
    }
    assert_eq!(jobs::claim(&mut conn, "plan", 100, TTL).unwrap().len(), 20);
}

pub(crate) fn explain(conn: &mut AnyConnection, sql: &str) -> String {
    #[derive(QueryableByName)]
    struct PgPlan {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    #[derive(QueryableByName)]
    struct MysqlPlan {
        #[diesel(sql_type = Text, column_name = "EXPLAIN")]
        line: String,
    }
    #[derive(QueryableByName)]
    struct SqlitePlan {
        #[diesel(sql_type = Text)]
        detail: String,
    }
    let lines: Vec<String> = match conn.backend() {
        Backend::Postgres => diesel::sql_query(format!("EXPLAIN {sql}"))
            .load::<PgPlan>(conn)
            .map(|rows| rows.into_iter().map(|r| r.line).collect()),
        Backend::Mysql => diesel::sql_query(format!("EXPLAIN FORMAT=JSON {sql}"))
            .load::<MysqlPlan>(conn)
            .map(|rows| rows.into_iter().map(|r| r.line).collect()),
        Backend::Sqlite => diesel::sql_query(format!("EXPLAIN QUERY PLAN {sql}"))
            .load::<SqlitePlan>(conn)
            .map(|rows| rows.into_iter().map(|r| r.detail).collect()),
    }
    .expect("explain the claim");
    lines.join("\n")
}

//! The ready ring (the servers' storage for what claims read, docs/storage-design.md): it
//! lists exactly the waiting jobs whatever changed them (here), its rotations lose and
//! duplicate nothing while claims, enqueues and cancels race them and reclaim the claims' dead
//! entries under a held snapshot ([`rotations`]), and callers' own transactions across
//! rotations never leave an entry behind nor lose one ([`transactions`]). On SQLite, which
//! claims from `tenure_jobs`, a rotation does nothing and the same races hold.

#[cfg(feature = "mysql")]
mod mariadb;
mod rotations;
mod transactions;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, JobClaim, NewJob, OnDuplicate, Retry};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, count};

conformance!(
    the_ring_lists_exactly_the_waiting_jobs,
    the_ring_follows_parked_jobs_workflows_schedules_and_bulk_retries,
);

pub(super) const TTL: Duration = Duration::from_secs(60);
pub(super) const NO_WAIT: Duration = Duration::ZERO;

pub(super) fn claims(jobs: &[jobs::ClaimedJob]) -> Vec<JobClaim> {
    jobs.iter().map(|j| j.claim()).collect()
}

#[derive(QueryableByName, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    queue: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    kind: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    priority: i32,
    #[diesel(sql_type = diesel::sql_types::Text)]
    due: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    limit_key: Option<String>,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    fair_stamp: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    fair_key: Option<String>,
}

/// A claimed job was due when it was claimed (both instants the database's).
pub(super) fn assert_not_early(job: &jobs::ClaimedJob) {
    assert!(
        job.due_at <= job.claimed_at,
        "job {} claimed at {} before its due time {}",
        job.id,
        job.claimed_at,
        job.due_at
    );
}

/// The servers: the ring's entries and the waiting jobs agree, one entry per waiting job
/// with its claim columns; on SQLite there is no ring and a rotation does nothing.
pub(super) fn assert_ring_exact(conn: &mut AnyConnection, backend: Backend, context: &str) {
    let columns = match backend {
        Backend::Sqlite => {
            assert_eq!(
                jobs::rotate_ready(conn, NO_WAIT).unwrap(),
                None,
                "{context}"
            );
            return;
        }
        Backend::Postgres => {
            "id, queue, kind, priority, due_at::text AS due, limit_key, fair_stamp, fair_key"
        }
        Backend::Mysql => {
            "id, CAST(queue AS CHAR) AS queue, CAST(kind AS CHAR) AS kind, priority, \
             CAST(due_at AS CHAR) AS due, CAST(limit_key AS CHAR) AS limit_key, fair_stamp, \
             CAST(fair_key AS CHAR) AS fair_key"
        }
    };
    let read = |conn: &mut AnyConnection, table: &str, filter: &str| -> Vec<Entry> {
        let sql = format!("SELECT {columns} FROM {table} {filter} ORDER BY id");
        diesel::sql_query(&sql)
            .load(conn)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    };
    let ring = read(conn, "tenure_ready", "");
    let waiting = read(conn, "tenure_jobs", "WHERE state = 'waiting'");
    assert_eq!(
        ring, waiting,
        "{context}: the ring differs from the waiting jobs"
    );
}

/// Every way a job starts or stops waiting, or changes what a claim reads of it while it
/// waits: the ring follows each, on its own and in bulk.
fn the_ring_lists_exactly_the_waiting_jobs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let check = |conn: &mut AnyConnection, what: &str| assert_ring_exact(conn, backend, what);
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![1])).unwrap();
    let later = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "b", vec![]).delay(Duration::from_secs(600)),
    )
    .unwrap()
    .id;
    check(&mut conn, "after single enqueues");
    let bulk: Vec<NewJob> = (0..300)
        .map(|i| NewJob::new("q", if i % 2 == 0 { "a" } else { "b" }, vec![]).priority(i % 5))
        .collect();
    jobs::enqueue_many(&mut conn, &bulk).unwrap();
    check(&mut conn, "after a bulk enqueue");
    // Fair jobs in bulk: their entries carry their tenants and turns (the claim orders by
    // them), limited ones beside them.
    let fair: Vec<NewJob> = (0..40)
        .map(|i| {
            let job = NewJob::new("q", "a", vec![]).fair_key(["t1", "t2", "t3"][i % 3]);
            if i % 4 == 0 { job.limit("fk", 3) } else { job }
        })
        .collect();
    jobs::enqueue_many(&mut conn, &fair).unwrap();
    check(&mut conn, "after a fair bulk enqueue");
    jobs::enqueue(&mut conn, &NewJob::new("q", "a", vec![]).limit("k", 2)).unwrap();
    check(&mut conn, "after a limited enqueue");
    // A duplicate that replaces the waiting job's payload and due time.
    let dedup = NewJob::new("q", "a", vec![])
        .dedup_key("d")
        .delay(Duration::from_secs(60));
    jobs::enqueue(&mut conn, &dedup).unwrap();
    let replace = NewJob::new("q", "a", vec![9])
        .dedup_key("d")
        .on_duplicate(OnDuplicate::Replace);
    jobs::enqueue(&mut conn, &replace).unwrap();
    check(&mut conn, "after a duplicate replaced a waiting job");
    let claimed = jobs::claim(&mut conn, "q", 40, TTL).unwrap();
    check(&mut conn, "after a claim");
    let (done, rest) = claimed.split_at(10);
    jobs::complete(&mut conn, &claims(done)).unwrap();
    let (failed, rest) = rest.split_at(10);
    for job in failed {
        jobs::fail(
            &mut conn,
            job.claim(),
            "again",
            Retry::After(Duration::from_secs(5)),
        )
        .unwrap();
    }
    check(&mut conn, "after retries");
    let (snoozed, rest) = rest.split_at(10);
    for job in snoozed {
        jobs::snooze(&mut conn, job.claim(), Duration::from_secs(30)).unwrap();
    }
    let (given_back, rest) = rest.split_at(5);
    jobs::give_back(&mut conn, &claims(given_back)).unwrap();
    check(&mut conn, "after snoozes and give-backs");
    for job in rest {
        jobs::fail(&mut conn, job.claim(), "dead", Retry::Never).unwrap();
    }
    jobs::retry_dead(&mut conn, rest[0].id).unwrap();
    check(&mut conn, "after dead jobs and a retry of one");
    assert!(jobs::cancel(&mut conn, later).unwrap());
    let fresh = jobs::enqueue(&mut conn, &NewJob::new("q", "c", vec![]))
        .unwrap()
        .id;
    assert!(jobs::cancel(&mut conn, fresh).unwrap());
    check(&mut conn, "after cancels");
    // A workflow's dependent: blocked (not in the ring) until its dependency completes.
    let first = jobs::enqueue(&mut conn, &NewJob::new("w", "a", vec![]))
        .unwrap()
        .id;
    let then = jobs::enqueue(
        &mut conn,
        &NewJob::new("w", "a", vec![]).depends_on([first]),
    )
    .unwrap()
    .id;
    check(&mut conn, "with a blocked dependent");
    let taken = jobs::claim(&mut conn, "w", 1, TTL).unwrap();
    assert_eq!(taken[0].id, first);
    jobs::complete(&mut conn, &claims(&taken)).unwrap();
    check(&mut conn, "after the dependency completed");
    assert_eq!(jobs::claim(&mut conn, "w", 1, TTL).unwrap()[0].id, then);
    // A lapsed claim rescued: waiting again.
    let lapsing = jobs::enqueue(&mut conn, &NewJob::new("r", "a", vec![]))
        .unwrap()
        .id;
    jobs::claim(&mut conn, "r", 1, Duration::from_millis(1)).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let rescued = jobs::rescue(&mut conn, 10).unwrap();
    assert!(rescued.requeued.contains(&lapsing), "{rescued:?}");
    check(&mut conn, "after a rescue");
    // Rotations in between change none of it.
    for _ in 0..4 {
        jobs::rotate_ready(&mut conn, NO_WAIT).unwrap();
    }
    check(&mut conn, "after rotations");
    // A waiting job deleted by hand leaves the ring too.
    let doomed = jobs::enqueue(&mut conn, &NewJob::new("q", "d", vec![]))
        .unwrap()
        .id;
    diesel::sql_query(format!("DELETE FROM tenure_jobs WHERE id = {doomed}"))
        .execute(&mut conn)
        .unwrap();
    check(&mut conn, "after a delete");
}

/// The paths the first exactness test leaves out, each followed by a rotation and a check:
/// parked jobs (enqueued parked, resumed, failed into a retry, completed, expired),
/// workflows (enqueued blocked, cancelled with their callbacks; a step dead, its dependents
/// settled and its callback released; the dead step retried by kind), a schedule's tick
/// (keyed enqueues), then a drain: every waiting job claimed once, the ring empty of them.
fn the_ring_follows_parked_jobs_workflows_schedules_and_bulk_retries(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let check = |conn: &mut AnyConnection, what: &str| {
        jobs::rotate_ready(conn, NO_WAIT).unwrap();
        assert_ring_exact(conn, backend, what);
    };
    let hour = Duration::from_secs(3600);
    let parked: Vec<_> = (0..4)
        .map(|i| {
            let deadline = if i == 3 { Duration::ZERO } else { hour };
            jobs::enqueue_parked(&mut conn, &NewJob::new("p", "a", vec![]), deadline).unwrap()
        })
        .collect();
    check(&mut conn, "after parked enqueues");
    jobs::resume_parked(&mut conn, &parked[0].token, None).unwrap();
    check(&mut conn, "after a resume");
    jobs::fail_parked(&mut conn, &parked[1].token, "declined").unwrap();
    check(&mut conn, "after a parked job failed into a retry");
    jobs::complete_parked(&mut conn, &parked[2].token, None).unwrap();
    check(&mut conn, "after a parked job completed");
    assert_eq!(
        jobs::expire_parked(&mut conn, 10).unwrap(),
        vec![parked[3].id]
    );
    check(&mut conn, "after a parked job expired");
    let workflow = |name: &str| {
        let mut w = jobs::Workflow::new(name);
        let first = w.add(NewJob::new(name, "a", vec![]));
        w.add(NewJob::new(name, "a", vec![]));
        w.add_after(&[first], NewJob::new(name, "b", vec![]));
        w.on_finish(NewJob::new(name, "c", vec![]));
        w
    };
    let cancelled = jobs::enqueue_workflow(&mut conn, &workflow("w1")).unwrap();
    check(&mut conn, "after a workflow enqueued");
    assert!(jobs::cancel_workflow(&mut conn, cancelled.id).unwrap() > 0);
    check(&mut conn, "after a workflow cancelled");
    jobs::enqueue_workflow(&mut conn, &workflow("w2")).unwrap();
    for job in jobs::claim_kinds(&mut conn, "w2", &["a"], 10, TTL).unwrap() {
        jobs::fail(&mut conn, job.claim(), "dead", Retry::Never).unwrap();
    }
    check(&mut conn, "after a workflow's steps died");
    assert_eq!(jobs::retry_dead_of_kind(&mut conn, "w2", "a").unwrap(), 2);
    check(&mut conn, "after the dead steps retried by kind");
    tenure::schedules::upsert(
        &mut conn,
        &tenure::schedules::Schedule::every(
            "s",
            Duration::from_secs(1),
            NewJob::new("s", "a", vec![]),
        ),
    )
    .unwrap();
    tenure::schedules::tick(&mut conn).unwrap();
    check(&mut conn, "after a schedule's tick");
    let mut claimed: HashMap<i64, usize> = HashMap::new();
    for queue in ["p", "w1", "w2", "s"] {
        loop {
            let batch = jobs::claim(&mut conn, queue, 10, TTL).unwrap();
            if batch.is_empty() {
                break;
            }
            for job in &batch {
                *claimed.entry(job.id).or_default() += 1;
            }
            jobs::complete(&mut conn, &claims(&batch)).unwrap();
            check(&mut conn, &format!("while draining {queue}"));
        }
    }
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{backend}: claimed twice: {twice:?}");
    let left: Vec<Entry> = diesel::sql_query(
        "SELECT id, queue, kind, priority, '' AS due, limit_key, fair_stamp, NULL AS fair_key \
         FROM tenure_jobs \
         WHERE state = 'waiting' ORDER BY id",
    )
    .load(&mut conn)
    .unwrap();
    println!("{backend}: left waiting {left:?}");
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting' \
                 AND id NOT IN ({}, {})",
                parked[1].id, parked[3].id
            )
        ),
        0,
        "{backend}: a job left waiting (but the failed and the expired parked ones, in their backoff)"
    );
}

/// A live database migrated to the ring keeps every job, and the ring lists its waiting ones
/// exactly: jobs in every state are written under the layout before it (the ring's migration
/// reverted by its own `down.sql`), then the migration runs again.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_live_database_migrates_into_the_ring() {
    // The job slots (tenure-0056) and fair claiming (tenure-0054) came after the ring:
    // reverted first, and run again after it.
    a_live_database_migrates_into_the_ring(
        Backend::Postgres,
        &[
            include_str!("../../../migrations/postgres/tenure-0056_job_slots/down.sql"),
            include_str!("../../../migrations/postgres/tenure-0054_fair_claiming/down.sql"),
            include_str!("../../../migrations/postgres/tenure-0045_ready_ring/down.sql"),
        ],
    );
}

/// [`postgres_a_live_database_migrates_into_the_ring`] on MariaDB.
#[cfg(feature = "mysql")]
#[test]
fn mysql_a_live_database_migrates_into_the_ring() {
    a_live_database_migrates_into_the_ring(
        Backend::Mysql,
        &[
            include_str!("../../../migrations/mysql/tenure-0054_fair_claiming/down.sql"),
            include_str!("../../../migrations/mysql/tenure-0045_ready_ring/down.sql"),
        ],
    );
}

/// `downs`: the ring's migration undone, and every later one that changed the ring first.
fn a_live_database_migrates_into_the_ring(backend: Backend, downs: &[&str]) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for down in downs {
        conn.batch_execute(down).unwrap();
    }
    let removed = diesel::sql_query(
        "DELETE FROM __diesel_schema_migrations WHERE version LIKE '%0045%' \
         OR version LIKE '%0054%' OR version LIKE '%0056%'",
    )
    .execute(&mut conn)
    .unwrap();
    assert_eq!(
        removed,
        downs.len(),
        "the ring's migrations are on record once each"
    );
    // Jobs as the layout before the ring wrote them (this build's enqueue writes columns a
    // later migration adds): 500 due at priorities 0-2, one due in ten minutes.
    let (now, soon) = match backend {
        Backend::Mysql => ("UTC_TIMESTAMP(6)", "UTC_TIMESTAMP(6) + INTERVAL 10 MINUTE"),
        _ => ("now()", "now() + interval '10 minutes'"),
    };
    let rows: Vec<String> = (0..500)
        .map(|i| {
            format!(
                "('live', 'a', 'x', {}, 'waiting', 0, 25, {now}, {now})",
                i % 3
            )
        })
        .chain([format!(
            "('live', 'a', 'x', 0, 'waiting', 0, 25, {soon}, {now})"
        )])
        .collect();
    conn.batch_execute(&format!(
        "INSERT INTO tenure_jobs (queue, kind, payload, priority, state, attempt, max_attempts, \
         due_at, created_at) VALUES {}",
        rows.join(", ")
    ))
    .unwrap();
    // Jobs in other states, written as the layout before the ring left them (its claim
    // cannot run here: this build's claim reads the ring).
    let (now, later) = match backend {
        Backend::Mysql => ("NOW(6)", "NOW(6) + INTERVAL 1 MINUTE"),
        _ => ("now()", "now() + interval '1 minute'"),
    };
    conn.batch_execute(&format!(
        "UPDATE tenure_jobs SET state = 'completed', finished_at = {now} WHERE id % 10 = 1; \
         UPDATE tenure_jobs SET state = 'dead', finished_at = {now} WHERE id % 10 = 2; \
         UPDATE tenure_jobs SET due_at = {later} WHERE id % 10 = 3"
    ))
    .unwrap();
    let waiting_before = count(
        &mut conn,
        "SELECT COUNT(*) AS n FROM tenure_jobs WHERE state = 'waiting'",
    );
    let all_before = count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs");
    let applied = tenure::run_migrations(&mut conn).unwrap();
    assert_eq!(applied.len(), downs.len(), "{applied:?}");
    assert_ring_exact(&mut conn, backend, "after migrating a live database");
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_ready"),
        waiting_before
    );
    assert_eq!(
        count(&mut conn, "SELECT COUNT(*) AS n FROM tenure_jobs"),
        all_before
    );
    // The waiting jobs due now drain once each.
    let mut drained = 0;
    loop {
        let batch = jobs::claim(&mut conn, "live", 100, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        drained += batch.len();
        jobs::complete(&mut conn, &claims(&batch)).unwrap();
    }
    assert_eq!(drained, 350, "the waiting jobs due now, each once");
}

/// Claims every job of queue `q` due now, completing each; returns their ids in order.
pub(super) fn drain(conn: &mut AnyConnection) -> Vec<i64> {
    let mut taken = Vec::new();
    loop {
        let batch = jobs::claim(conn, "q", 10, TTL).unwrap();
        if batch.is_empty() {
            break;
        }
        taken.extend(batch.iter().map(|j| j.id));
        jobs::complete(conn, &claims(&batch)).unwrap();
    }
    taken.sort_unstable();
    taken
}

/// Up to `wanted` rotations on `conn`, tried at most a thousand times (a rotation may find
/// the ring busy); returns how many ran.
pub(super) fn rotate_times(conn: &mut AnyConnection, wanted: usize) -> usize {
    let mut rotated = 0;
    for _ in 0..1000 {
        if rotated == wanted {
            break;
        }
        if jobs::rotate_ready(conn, NO_WAIT).unwrap().is_some() {
            rotated += 1;
        }
    }
    rotated
}

/// A thread rotating the ring on its own connection as often as it can (`pause` between
/// calls) until `stop`, counting the rotations done; a failed rotation fails the test.
pub(super) fn spawn_rotator(
    mut conn: AnyConnection,
    stop: Arc<AtomicBool>,
    pause: Duration,
) -> (std::thread::JoinHandle<()>, Arc<AtomicUsize>) {
    let rotations = Arc::new(AtomicUsize::new(0));
    let done = rotations.clone();
    let thread = std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            if jobs::rotate_ready(&mut conn, NO_WAIT)
                .expect("a rotation must not fail")
                .is_some()
            {
                done.fetch_add(1, Ordering::SeqCst);
            }
            std::thread::sleep(pause);
        }
    });
    (thread, rotations)
}

//! tenure's models (`Job`, `LeaseRecord`, `ScheduleRecord`, `FailedRun`, `RunOutput`) and
//! portable types (instants, tokens) load and round-trip through `AnyConnection` and pooled
//! connections on every backend; `JobFilter` selects by ids and dedup key.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use tenure::jobs::{self, FailedRun, JobFilter, JobState, NewJob, Retry, RunOutput};
use tenure::lease::LeaseRecord;
use tenure::schedules::{self, Schedule, ScheduleRecord};
use tenure::schema::{
    tenure_job_errors, tenure_job_outputs, tenure_jobs, tenure_leases, tenure_limit_keys,
    tenure_queue_pauses, tenure_schedules,
};
use tenure::sql_types::{DatabaseNow, InstantValue, TokenValue};
use tenure::{AnyConnection, Backend, Error};

use crate::common::{TestDb, conformance};

conformance!(
    portable_types_round_trip_through_any_connection,
    job_filter_selects_by_ids_and_dedup_key,
);

const TTL: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// Instants, tokens and the models through AnyConnection and pooled connections.

fn at_millis(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(t.timestamp_millis()).unwrap()
}

fn portable_types_round_trip_through_any_connection(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let pool = db.pool(2);
    let mut pooled = pool.get().unwrap();

    // Instants: bound chrono values and the database's clock.
    let later = at_millis(Utc::now() + chrono::Duration::hours(1));
    let soon = jobs::enqueue(&mut conn, &NewJob::new("t", "k", vec![]))
        .unwrap()
        .id;
    let scheduled = jobs::enqueue(&mut conn, &NewJob::new("t", "k", vec![]).at(later))
        .unwrap()
        .id;
    let due: Vec<i64> = tenure_jobs::table
        .filter(tenure_jobs::due_at.le(DatabaseNow))
        .select(tenure_jobs::id)
        .load(&mut conn)
        .unwrap();
    assert_eq!(due, vec![soon]);
    let not_yet: Vec<i64> = tenure_jobs::table
        .filter(tenure_jobs::due_at.gt(DatabaseNow))
        .select(tenure_jobs::id)
        .load(&mut conn)
        .unwrap();
    assert_eq!(not_yet, vec![scheduled]);
    let exactly: Vec<(i64, DateTime<Utc>)> = tenure_jobs::table
        .filter(tenure_jobs::due_at.eq(InstantValue(later)))
        .select((tenure_jobs::id, tenure_jobs::due_at))
        .load(&mut conn)
        .unwrap();
    assert_eq!(exactly, vec![(scheduled, later)]);
    let before_later: i64 = tenure_jobs::table
        .filter(tenure_jobs::due_at.lt(InstantValue(later)))
        .count()
        .get_result(&mut conn)
        .unwrap();
    assert_eq!(before_later, 1);
    let created: Vec<DateTime<Utc>> = tenure_jobs::table
        .order(tenure_jobs::id)
        .select(tenure_jobs::created_at)
        .load(&mut *pooled)
        .unwrap();
    assert_eq!(created.len(), 2);
    assert!(
        (Utc::now() - created[0]).num_seconds().abs() < 60,
        "{created:?}"
    );

    // Tokens and lease instants.
    let mut lease = tenure::lease::try_take(&mut conn, "portable", TTL, "me")
        .unwrap()
        .expect("a free lease");
    let token: Option<uuid::Uuid> = tenure_leases::table
        .find(("portable", 0))
        .select(tenure_leases::token)
        .first(&mut conn)
        .unwrap();
    assert_eq!(token, Some(lease.token()));
    let by_token: Vec<String> = tenure_leases::table
        .filter(tenure_leases::token.eq(TokenValue(lease.token())))
        .select(tenure_leases::name)
        .load(&mut conn)
        .unwrap();
    assert_eq!(by_token, vec!["portable".to_string()]);
    let live: i64 = tenure_leases::table
        .filter(tenure_leases::expires_at.gt(DatabaseNow))
        .count()
        .get_result(&mut conn)
        .unwrap();
    assert_eq!(live, 1);
    let past_bound: i64 = tenure_leases::table
        .filter(tenure_leases::expires_at.gt(InstantValue(Utc::now() + chrono::Duration::hours(1))))
        .count()
        .get_result(&mut conn)
        .unwrap();
    assert_eq!(past_bound, 0);
    let record: LeaseRecord = tenure_leases::table
        .select(LeaseRecord::as_select())
        .first(&mut conn)
        .unwrap();
    assert_eq!(
        (
            record.name.as_str(),
            record.token,
            record.holder.as_str(),
            record.fence,
            record.acquired_at,
            record.expires_at,
        ),
        (
            "portable",
            Some(lease.token()),
            "me",
            lease.fence(),
            lease.acquired_at(),
            lease.expires_at(),
        )
    );
    let pooled_records: Vec<LeaseRecord> = tenure_leases::table
        .select(LeaseRecord::as_select())
        .load(&mut *pooled)
        .unwrap();
    assert_eq!(pooled_records, vec![record]);
    assert!(lease.release(&mut conn).unwrap());
    let released: Option<uuid::Uuid> = tenure_leases::table
        .select(tenure_leases::token)
        .first(&mut *pooled)
        .unwrap();
    assert_eq!(released, None);

    // Schedules.
    schedules::upsert(
        &mut conn,
        &Schedule::every(
            "every-5m",
            Duration::from_secs(300),
            NewJob::new("s", "tick", b"x".to_vec())
                .dedup_key("d")
                .limit("L", 3)
                .delay(Duration::from_secs(2)),
        )
        .catch_up(true),
    )
    .unwrap();
    let schedule: ScheduleRecord = tenure_schedules::table
        .select(ScheduleRecord::as_select())
        .first(&mut conn)
        .unwrap();
    assert_eq!(
        (
            schedule.name.as_str(),
            schedule.cron.as_deref(),
            schedule.interval_micros,
            schedule.queue.as_str(),
            schedule.payload.as_slice(),
            schedule.dedup_key.as_deref(),
            schedule.limit_key.as_deref(),
            schedule.limit_max,
            schedule.delay_micros,
            schedule.catch_up,
            schedule.paused,
        ),
        (
            "every-5m",
            None,
            Some(300_000_000),
            "s",
            &b"x"[..],
            Some("d"),
            Some("L"),
            Some(3),
            2_000_000,
            1,
            0,
        )
    );
    let pooled_schedules: Vec<ScheduleRecord> = tenure_schedules::table
        .filter(tenure_schedules::next_due_at.gt(DatabaseNow))
        .select(ScheduleRecord::as_select())
        .load(&mut *pooled)
        .unwrap();
    assert_eq!(pooled_schedules, vec![schedule]);

    // Failed runs and outputs, and tenure's own joinable!s.
    let failing = jobs::enqueue(&mut conn, &NewJob::new("f", "flaky", vec![]))
        .unwrap()
        .id;
    let claimed = jobs::claim(&mut conn, "f", 1, TTL).unwrap().remove(0);
    jobs::fail(&mut conn, claimed.claim(), "boom", Retry::Never).unwrap();
    jobs::record_output(&mut conn, failing, 1, Some(3), b"partial\n").unwrap();
    let runs: Vec<FailedRun> = tenure_job_errors::table
        .filter(tenure_job_errors::job_id.eq(failing))
        .select(FailedRun::as_select())
        .load(&mut conn)
        .unwrap();
    assert_eq!(runs, jobs::history(&mut conn, failing).unwrap());
    assert_eq!((runs[0].attempt, runs[0].error.as_str()), (1, "boom"));
    // Nullable instants against a bound instant and the database's clock.
    let finished: Vec<i64> = tenure_jobs::table
        .filter(tenure_jobs::finished_at.lt(InstantValue(Utc::now() + chrono::Duration::hours(1))))
        .filter(tenure_jobs::finished_at.le(DatabaseNow.nullable()))
        .select(tenure_jobs::id)
        .load(&mut conn)
        .unwrap();
    assert_eq!(finished, vec![failing]);
    let joined: Vec<(String, JobState, FailedRun)> = tenure_job_errors::table
        .inner_join(tenure_jobs::table)
        .select((
            tenure_jobs::kind,
            tenure_jobs::state,
            FailedRun::as_select(),
        ))
        .load(&mut *pooled)
        .unwrap();
    assert_eq!(
        joined,
        vec![("flaky".to_string(), JobState::Dead, runs[0].clone())]
    );
    let outputs: Vec<RunOutput> = tenure_job_outputs::table
        .inner_join(tenure_jobs::table)
        .filter(tenure_jobs::id.eq(failing))
        .select(RunOutput::as_select())
        .load(&mut conn)
        .unwrap();
    assert_eq!(outputs, jobs::outputs(&mut conn, failing).unwrap());
    assert_eq!(
        (outputs[0].exit_code, outputs[0].output.as_slice()),
        (Some(3), &b"partial\n"[..])
    );

    // The remaining tables read through AnyConnection too.
    jobs::pause(&mut conn, "paused-q").unwrap();
    let paused: Vec<(String, DateTime<Utc>)> = tenure_queue_pauses::table
        .filter(tenure_queue_pauses::paused_at.le(DatabaseNow))
        .select((tenure_queue_pauses::queue, tenure_queue_pauses::paused_at))
        .load(&mut conn)
        .unwrap();
    assert_eq!(paused.len(), 1);
    assert_eq!(paused[0].0, "paused-q");
    let _keys: Vec<String> = tenure_limit_keys::table
        .select(tenure_limit_keys::limit_key)
        .load(&mut *pooled)
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// JobFilter: ids and dedup key.

fn job_filter_selects_by_ids_and_dedup_key(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut ids = Vec::new();
    for i in 0..6 {
        let mut job = NewJob::new(if i % 2 == 0 { "even" } else { "odd" }, "k", vec![]);
        if i < 3 {
            job = job.dedup_key(format!("key-{i}"));
        }
        ids.push(jobs::enqueue(&mut conn, &job).unwrap().id);
    }
    // A finished job keeps its key; a new live job may take it again.
    let done = jobs::claim(&mut conn, "odd", 1, TTL).unwrap().remove(0);
    assert_eq!(done.id, ids[1]);
    jobs::complete(&mut conn, &[done.claim()]).unwrap();
    let again = jobs::enqueue(
        &mut conn,
        &NewJob::new("odd", "k", vec![]).dedup_key("key-1"),
    )
    .unwrap();
    assert!(!again.existing);

    let listed = |conn: &mut AnyConnection, filter: JobFilter| -> Vec<i64> {
        jobs::list(conn, &filter)
            .unwrap()
            .into_iter()
            .map(|j| j.id)
            .collect()
    };
    let absent = ids.iter().max().unwrap() + 1000;
    assert_eq!(
        listed(
            &mut conn,
            JobFilter {
                ids: Some(vec![ids[0], ids[4], absent, ids[4]]),
                ..JobFilter::default()
            }
        ),
        vec![ids[4], ids[0]],
        "newest first, each once, absent ids ignored"
    );
    assert_eq!(
        listed(
            &mut conn,
            JobFilter {
                dedup_key: Some("key-1".into()),
                ..JobFilter::default()
            }
        ),
        vec![again.id, ids[1]]
    );
    assert_eq!(
        listed(
            &mut conn,
            JobFilter {
                dedup_key: Some("key-1".into()),
                state: Some(JobState::Completed),
                ..JobFilter::default()
            }
        ),
        vec![ids[1]]
    );
    assert_eq!(
        listed(
            &mut conn,
            JobFilter {
                ids: Some(vec![ids[0], ids[1], ids[2]]),
                dedup_key: Some("key-2".into()),
                ..JobFilter::default()
            }
        ),
        vec![ids[2]]
    );
    assert_eq!(
        listed(
            &mut conn,
            JobFilter {
                ids: Some(ids.clone()),
                queue: Some("even".into()),
                limit: 2,
                ..JobFilter::default()
            }
        ),
        vec![ids[4], ids[2]]
    );
    // Byte-exact keys.
    assert!(
        listed(
            &mut conn,
            JobFilter {
                dedup_key: Some("KEY-1".into()),
                ..JobFilter::default()
            }
        )
        .is_empty()
    );
    assert!(
        listed(
            &mut conn,
            JobFilter {
                ids: Some(vec![]),
                ..JobFilter::default()
            }
        )
        .is_empty()
    );
    // The most ids a filter takes, then one more.
    let mut many: Vec<i64> = (0..1000).map(|i| absent + i).collect();
    many[999] = ids[3];
    assert_eq!(
        listed(
            &mut conn,
            JobFilter {
                ids: Some(many.clone()),
                ..JobFilter::default()
            }
        ),
        vec![ids[3]]
    );
    many.push(ids[5]);
    let refused = jobs::list(
        &mut conn,
        &JobFilter {
            ids: Some(many),
            ..JobFilter::default()
        },
    );
    assert!(
        matches!(refused, Err(Error::InvalidInput { field: "ids", .. })),
        "{refused:?}"
    );
}

//! `tenure::schema` is a contract: its `table!` definitions match what the migrations create on
//! every backend, its models load through `AnyConnection` (and pooled connections), and an
//! application can join its own tables to tenure's with the same code on every backend.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::jobs::{self, FailedRun, Job, JobFilter, JobState, NewJob, Retry, RunOutput};
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
    the_schema_matches_the_migrated_database,
    the_schema_check_reports_drift,
    the_readme_join_example_runs,
    portable_types_round_trip_through_any_connection,
    job_filter_selects_by_ids_and_dedup_key,
);

const TTL: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// The schema against the migrated database.

/// A column as `tenure::schema` declares it, read from diesel's own types.
#[derive(Debug, Clone)]
struct ColumnSpec {
    name: &'static str,
    /// `std::any::type_name` of the column's SQL type, e.g.
    /// `diesel::sql_types::Nullable<tenure::sql_types::Instant>`.
    sql_type: &'static str,
}

impl ColumnSpec {
    fn nullable(&self) -> bool {
        self.sql_type.starts_with("diesel::sql_types::Nullable<")
    }

    /// The SQL type without `Nullable` and without its path: `Text`, `Instant`, ...
    fn family(&self) -> &'static str {
        let inner = self
            .sql_type
            .strip_prefix("diesel::sql_types::Nullable<")
            .and_then(|t| t.strip_suffix('>'))
            .unwrap_or(self.sql_type);
        inner.rsplit("::").next().unwrap_or(inner)
    }
}

#[derive(Debug, Clone)]
struct TableSpec {
    name: &'static str,
    columns: Vec<ColumnSpec>,
}

/// The spec of a `tenure::schema` table: each listed column's `diesel::Column::NAME` and the
/// type name of its SQL type. The list must be exactly the table's `all_columns`, in order:
/// otherwise this does not compile.
macro_rules! table_spec {
    ($table:ident { $($column:ident),+ $(,)? }) => {{
        let _exactly_all_columns: ($(tenure::schema::$table::$column,)+) =
            tenure::schema::$table::all_columns;
        TableSpec {
            name: stringify!($table),
            columns: vec![$(ColumnSpec {
                name: <tenure::schema::$table::$column as diesel::Column>::NAME,
                sql_type: std::any::type_name::<
                    <tenure::schema::$table::$column as diesel::Expression>::SqlType,
                >(),
            }),+],
        }
    }};
}

/// Every table of `tenure::schema` (checked against the number of `table!`s in src/schema.rs).
fn schema_tables() -> Vec<TableSpec> {
    let tables = vec![
        table_spec!(tenure_leases {
            name,
            token,
            holder,
            fence,
            acquired_at,
            expires_at,
        }),
        table_spec!(tenure_jobs {
            id,
            queue,
            kind,
            payload,
            priority,
            state,
            attempt,
            max_attempts,
            due_at,
            created_at,
            claim_token,
            claimed_at,
            claim_expires_at,
            finished_at,
            last_error,
            dedup_key,
            dedup_hits,
            limit_key,
            limit_max,
            lapses,
            cancel_requested_at,
            snoozes,
            dedup_window_micros,
            workflow_id,
            run_when,
            stripes_pending,
            dependents,
            progress,
            progress_message,
            claimed_by,
            started_at,
        }),
        table_spec!(tenure_job_errors {
            id,
            job_id,
            attempt,
            error,
            failed_at,
        }),
        table_spec!(tenure_job_outputs {
            id,
            job_id,
            attempt,
            exit_code,
            output,
            finished_at,
        }),
        table_spec!(tenure_queue_pauses { queue, paused_at }),
        table_spec!(tenure_schedules {
            name,
            cron,
            interval_micros,
            time_zone,
            queue,
            kind,
            payload,
            priority,
            max_attempts,
            catch_up,
            paused,
            next_due_at,
            dedup_key,
            limit_key,
            limit_max,
            delay_micros,
        }),
        table_spec!(tenure_limit_keys {
            limit_key,
            throttled_until,
            throttled_max,
            throttled_period_us,
            starts_kept
        }),
        table_spec!(tenure_job_limits {
            job_id,
            limit_key,
            max_running,
            rate_max,
            rate_period_us
        }),
        table_spec!(tenure_limit_starts {
            limit_key,
            started_at,
            job_id
        }),
        table_spec!(tenure_queue_limits { queue, max_running }),
        table_spec!(tenure_workflows {
            id,
            name,
            created_at,
            on_success,
            on_failure,
            on_finish
        }),
        table_spec!(tenure_job_dependencies {
            job_id,
            depends_on,
            stripe,
            counted,
            run_when
        }),
        table_spec!(tenure_dependency_stripes {
            job_id,
            stripe,
            pending
        }),
        table_spec!(tenure_job_results {
            job_id,
            format,
            body
        }),
        table_spec!(tenure_workers {
            id,
            host,
            pid,
            started_at,
            heartbeat_at,
            lock_free_since
        }),
    ];
    let source = include_str!("../../src/schema.rs");
    assert_eq!(
        source.matches("diesel::table! {").count(),
        tables.len(),
        "src/schema.rs has a table! this test does not list"
    );
    tables
}

/// Database columns that `tenure::schema` leaves out on purpose: (backend, table, column, why).
const BACKEND_INTERNAL_COLUMNS: &[(Backend, &str, &str, &str)] = &[(
    Backend::Mysql,
    "tenure_jobs",
    "live_dedup_key",
    "generated (STORED): the dedup key while the job is live, for the unique index that \
     MariaDB/MySQL cannot make partial",
)];

/// Tables in a tenure database that are not tenure's.
const IGNORED_TABLES: &[&str] = &["__diesel_schema_migrations"];

/// A column as the database reports it.
#[derive(Debug, Clone, QueryableByName)]
struct DbColumn {
    #[diesel(sql_type = diesel::sql_types::Text)]
    t: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    c: String,
    /// `YES` or `NO`.
    #[diesel(sql_type = diesel::sql_types::Text)]
    nullable: String,
    /// PostgreSQL: `data_type`; MariaDB: `data_type`; SQLite: the declared type.
    #[diesel(sql_type = diesel::sql_types::Text)]
    ty: String,
    /// MariaDB: `column_type` (with its length or precision); elsewhere `ty` again.
    #[diesel(sql_type = diesel::sql_types::Text)]
    detail: String,
}

fn database_columns(conn: &mut AnyConnection, backend: Backend) -> Vec<DbColumn> {
    let sql = match backend {
        Backend::Postgres => {
            "SELECT table_name::text AS t, column_name::text AS c, is_nullable::text AS nullable, \
                    data_type::text AS ty, data_type::text AS detail \
             FROM information_schema.columns WHERE table_schema = current_schema() \
             ORDER BY table_name, ordinal_position"
        }
        Backend::Mysql => {
            "SELECT table_name AS t, column_name AS c, is_nullable AS nullable, \
                    LOWER(data_type) AS ty, LOWER(column_type) AS detail \
             FROM information_schema.columns WHERE table_schema = DATABASE() \
             ORDER BY table_name, ordinal_position"
        }
        // A rowid alias (INTEGER PRIMARY KEY) is never NULL though pragma reports notnull=0.
        Backend::Sqlite => {
            "SELECT m.name AS t, p.name AS c, \
                    CASE WHEN p.\"notnull\" = 1 OR (p.pk = 1 AND UPPER(p.type) = 'INTEGER') \
                         THEN 'NO' ELSE 'YES' END AS nullable, \
                    UPPER(p.type) AS ty, UPPER(p.type) AS detail \
             FROM sqlite_schema m, pragma_table_info(m.name) p \
             WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' \
             ORDER BY m.name, p.cid"
        }
    };
    diesel::sql_query(sql)
        .load(conn)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Whether a database column's type is of the family of a `tenure::schema` SQL type.
fn type_matches(backend: Backend, family: &str, column: &DbColumn) -> bool {
    let (ty, detail) = (column.ty.as_str(), column.detail.as_str());
    match (backend, family) {
        (Backend::Postgres, "Text") => ty == "text",
        (Backend::Postgres, "BigInt") => ty == "bigint",
        (Backend::Postgres, "Integer") => ty == "integer",
        (Backend::Postgres, "Binary") => ty == "bytea",
        (Backend::Postgres, "Instant") => ty == "timestamp with time zone",
        (Backend::Postgres, "Token") => ty == "uuid",
        (Backend::Postgres, "Double") => ty == "double precision",
        (Backend::Mysql, "Text") => matches!(ty, "varbinary" | "varchar" | "text"),
        (Backend::Mysql, "BigInt") => ty == "bigint",
        (Backend::Mysql, "Integer") => ty == "int",
        (Backend::Mysql, "Double") => ty == "double",
        (Backend::Mysql, "Binary") => ty.ends_with("blob"),
        // Microseconds, and 16 bytes exactly.
        (Backend::Mysql, "Instant") => ty == "datetime" && detail == "datetime(6)",
        (Backend::Mysql, "Token") => ty == "binary" && detail == "binary(16)",
        (Backend::Sqlite, "Text") => ty == "TEXT",
        (Backend::Sqlite, "BigInt" | "Integer") => ty == "INTEGER",
        (Backend::Sqlite, "Binary") => ty == "BLOB",
        (Backend::Sqlite, "Instant") => ty == "TEXT",
        (Backend::Sqlite, "Token") => ty == "BLOB",
        (Backend::Sqlite, "Double") => ty == "REAL",
        _ => false,
    }
}

/// What differs between the schema and the database, one line per difference (empty: they
/// match).
fn schema_mismatches(backend: Backend, tables: &[TableSpec], db: &[DbColumn]) -> Vec<String> {
    let mut found = Vec::new();
    for column in db {
        if IGNORED_TABLES.contains(&column.t.as_str()) {
            continue;
        }
        let internal = BACKEND_INTERNAL_COLUMNS
            .iter()
            .any(|&(b, t, c, _)| b == backend && t == column.t && c == column.c);
        let Some(table) = tables.iter().find(|t| t.name == column.t) else {
            found.push(format!(
                "{}.{}: in the database, not in tenure::schema (no such table)",
                column.t, column.c
            ));
            continue;
        };
        let Some(spec) = table.columns.iter().find(|s| s.name == column.c) else {
            if !internal {
                found.push(format!(
                    "{}.{}: in the database, not in tenure::schema",
                    column.t, column.c
                ));
            }
            continue;
        };
        if internal {
            found.push(format!(
                "{}.{}: listed as backend-internal, yet tenure::schema has it",
                column.t, column.c
            ));
        }
        let db_nullable = column.nullable == "YES";
        if spec.nullable() != db_nullable {
            found.push(format!(
                "{}.{}: tenure::schema says {}, the database says {}",
                column.t,
                column.c,
                if spec.nullable() { "NULL" } else { "NOT NULL" },
                if db_nullable { "NULL" } else { "NOT NULL" },
            ));
        }
        if !type_matches(backend, spec.family(), column) {
            found.push(format!(
                "{}.{}: tenure::schema says {}, the database has {} ({})",
                column.t,
                column.c,
                spec.family(),
                column.ty,
                column.detail
            ));
        }
    }
    for table in tables {
        for spec in &table.columns {
            if !db.iter().any(|c| c.t == table.name && c.c == spec.name) {
                found.push(format!(
                    "{}.{}: in tenure::schema, not in the database",
                    table.name, spec.name
                ));
            }
        }
    }
    for &(b, t, c, _) in BACKEND_INTERNAL_COLUMNS {
        if b == backend && !db.iter().any(|col| col.t == t && col.c == c) {
            found.push(format!(
                "{t}.{c}: listed as backend-internal, not in the database"
            ));
        }
    }
    found.sort();
    found
}

fn the_schema_matches_the_migrated_database(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let tables = schema_tables();
    let columns = database_columns(&mut conn, backend);
    let mismatches = schema_mismatches(backend, &tables, &columns);
    assert!(
        mismatches.is_empty(),
        "{backend}: tenure::schema differs from the migrated database:\n{}",
        mismatches.join("\n")
    );
    let checked: usize = tables.iter().map(|t| t.columns.len()).sum();
    println!(
        "{backend}: {} tables, {checked} columns match (names, nullability, types)",
        tables.len()
    );
}

/// The check fails when it should: a column or table the schema lacks, a wrong type, a wrong
/// nullability, a column the database lacks.
fn the_schema_check_reports_drift(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // tenure's SQLite migrations spell 64-bit integers INTEGER, and the check wants that.
    let bigint = if backend == Backend::Sqlite {
        "INTEGER"
    } else {
        "BIGINT"
    };
    conn.batch_execute(&format!(
        "ALTER TABLE tenure_jobs ADD COLUMN extra {bigint} NULL; \
         CREATE TABLE tenure_surprise (id {bigint} NOT NULL PRIMARY KEY)"
    ))
    .unwrap();
    let columns = database_columns(&mut conn, backend);
    let tables = schema_tables();
    assert_eq!(
        schema_mismatches(backend, &tables, &columns),
        vec![
            "tenure_jobs.extra: in the database, not in tenure::schema".to_string(),
            "tenure_surprise.id: in the database, not in tenure::schema (no such table)"
                .to_string(),
        ]
    );

    // A schema that got a type, a nullability and a column wrong.
    let mut wrong = tables.clone();
    let jobs = wrong.iter_mut().find(|t| t.name == "tenure_jobs").unwrap();
    for spec in &mut jobs.columns {
        match spec.name {
            "priority" => spec.sql_type = "diesel::sql_types::Text",
            "last_error" => spec.sql_type = "diesel::sql_types::Text",
            "due_at" => spec.sql_type = "tenure::sql_types::Token",
            _ => {}
        }
    }
    jobs.columns.push(ColumnSpec {
        name: "ghost",
        sql_type: "diesel::sql_types::Text",
    });
    jobs.columns.push(ColumnSpec {
        name: "extra",
        sql_type: "diesel::sql_types::Nullable<diesel::sql_types::BigInt>",
    });
    wrong.push(TableSpec {
        name: "tenure_surprise",
        columns: vec![ColumnSpec {
            name: "id",
            sql_type: "diesel::sql_types::BigInt",
        }],
    });
    let report = schema_mismatches(backend, &wrong, &columns);
    let expected_types = |name: &str| {
        columns
            .iter()
            .find(|c| c.t == "tenure_jobs" && c.c == name)
            .map(|c| format!("{} ({})", c.ty, c.detail))
            .unwrap()
    };
    assert_eq!(
        report,
        vec![
            format!(
                "tenure_jobs.due_at: tenure::schema says Token, the database has {}",
                expected_types("due_at")
            ),
            "tenure_jobs.ghost: in tenure::schema, not in the database".to_string(),
            "tenure_jobs.last_error: tenure::schema says NOT NULL, the database says NULL"
                .to_string(),
            format!(
                "tenure_jobs.priority: tenure::schema says Text, the database has {}",
                expected_types("priority")
            ),
        ],
        "{backend}"
    );
}

// ---------------------------------------------------------------------------------------------
// An application's table joined to tenure's.

diesel::table! {
    users (id) {
        id -> BigInt,
        name -> Text,
        welcome_job_id -> Nullable<BigInt>,
    }
}

diesel::joinable!(users -> tenure::schema::tenure_jobs (welcome_job_id));
// Not `allow_tables_to_appear_in_same_query!(users, tenure_jobs)`: with diesel's `postgres`
// feature it also implements the trait for `Only<users::table>` and
// `Tablesample<users::table, _>` against `tenure_jobs::table`, which the orphan rules refuse
// outside tenure (E0117). The two impls a join needs are allowed.
impl diesel::query_source::TableNotEqual<tenure_jobs::table> for users::table {}
impl diesel::query_source::TableNotEqual<users::table> for tenure_jobs::table {}

fn the_readme_join_example_runs(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    conn.batch_execute(
        "CREATE TABLE users (id BIGINT PRIMARY KEY, name TEXT NOT NULL, welcome_job_id BIGINT NULL)",
    )
    .unwrap();
    let welcome = |priority| NewJob::new("welcome", "mail", vec![]).priority(priority);
    let ada = jobs::enqueue(&mut conn, &welcome(0)).unwrap().id;
    let bob = jobs::enqueue(&mut conn, &welcome(-2)).unwrap().id;
    let cy = jobs::enqueue(&mut conn, &welcome(-1)).unwrap().id;
    let eve = jobs::enqueue(&mut conn, &welcome(0)).unwrap().id;
    // Waiting, but nobody's welcome job.
    jobs::enqueue(&mut conn, &welcome(0)).unwrap();
    for (id, name, job) in [
        (1, "ada", Some(ada)),
        (2, "bob", Some(bob)),
        (3, "cy", Some(cy)),
        (4, "dee", None),
        (5, "eve", Some(eve)),
    ] {
        diesel::insert_into(users::table)
            .values((
                users::id.eq(id),
                users::name.eq(name),
                users::welcome_job_id.eq(job),
            ))
            .execute(&mut conn)
            .unwrap();
    }
    // The two of lowest priority: bob's and cy's. Bob's completes; cy's stays running.
    let claimed = jobs::claim(&mut conn, "welcome", 2, TTL).unwrap();
    let claimed_ids: Vec<i64> = claimed.iter().map(|j| j.id).collect();
    assert_eq!(claimed_ids, vec![bob, cy]);
    jobs::complete(&mut conn, &[claimed[0].claim()]).unwrap();

    // Users whose welcome job is still waiting: the README's query, on AnyConnection.
    let waiting: Vec<(String, Job)> = users::table
        .inner_join(tenure_jobs::table)
        .filter(tenure_jobs::state.eq(JobState::Waiting))
        .order(users::id)
        .select((users::name, Job::as_select()))
        .load(&mut conn)
        .unwrap();
    let expected = vec![
        (
            "ada".to_string(),
            jobs::get(&mut conn, ada).unwrap().unwrap(),
        ),
        (
            "eve".to_string(),
            jobs::get(&mut conn, eve).unwrap().unwrap(),
        ),
    ];
    assert_eq!(waiting, expected);
    assert!(
        waiting
            .iter()
            .all(|(_, job)| job.state == JobState::Waiting)
    );

    // Every user with their welcome job's state, if any.
    let states: Vec<(String, Option<JobState>)> = users::table
        .left_join(tenure_jobs::table)
        .order(users::id)
        .select((users::name, tenure_jobs::state.nullable()))
        .load(&mut conn)
        .unwrap();
    assert_eq!(
        states,
        vec![
            ("ada".to_string(), Some(JobState::Waiting)),
            ("bob".to_string(), Some(JobState::Completed)),
            ("cy".to_string(), Some(JobState::Running)),
            ("dee".to_string(), None),
            ("eve".to_string(), Some(JobState::Waiting)),
        ]
    );
}

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
        .find("portable")
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

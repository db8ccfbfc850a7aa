//! `tenure::schema` is a contract: its `table!` definitions match what the migrations create on
//! every backend, and an application can join its own tables to tenure's with the same code on
//! every backend (the models through `AnyConnection`: `schema_models.rs`).

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use tenure::Backend;
use tenure::jobs::{self, Job, JobState, NewJob};
use tenure::schema::tenure_jobs;

use crate::common::{TestDb, conformance};

mod database;
use database::{database_columns, schema_mismatches};

conformance!(
    the_schema_matches_the_migrated_database,
    the_schema_check_reports_drift,
    the_readme_join_example_runs,
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
            slot,
            token,
            holder,
            fence,
            acquired_at,
            expires_at,
            reusable_at,
            lock_delay_us,
            value,
            held_by,
        }),
        table_spec!(tenure_lease_names {
            name,
            holders,
            fence,
            next_ticket,
        }),
        table_spec!(tenure_lease_waiters {
            name,
            ticket,
            holder,
            joined_at,
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
            sequence_key,
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
        table_spec!(tenure_sequences {
            sequence_key,
            last_job_id,
        }),
        table_spec!(tenure_fair_keys {
            queue,
            fair_key,
            weight,
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
        table_spec!(tenure_parked {
            job_id,
            token_hash,
            claim_token,
            parked_at,
            deadline,
            backoff_base_micros,
            backoff_max_micros,
            answer,
            value_format,
            value_body,
            answer_error,
            answered_at
        }),
        table_spec!(tenure_steps {
            job_id,
            name,
            result,
            created_at
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
    let source = include_str!("../../../src/schema.rs");
    assert_eq!(
        source.matches("diesel::table! {").count(),
        tables.len(),
        "src/schema.rs has a table! this test does not list"
    );
    tables
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

//! The migrated database as it reports itself (its columns, per backend's catalog), and how
//! it differs from `tenure::schema`: the check the contract's tests run.

use diesel::prelude::*;
use tenure::{AnyConnection, Backend};

use super::TableSpec;

/// Database columns that `tenure::schema` leaves out on purpose: (backend, table, column, why).
const BACKEND_INTERNAL_COLUMNS: &[(Backend, &str, &str, &str)] = &[
    (
        Backend::Mysql,
        "tenure_jobs",
        "ready_entry_by_insert",
        "MariaDB: the insert that made the job wrote its ready entry itself, so the ring's row \
         trigger passes the row by (a bulk enqueue's chunks: one statement, not a trigger a job)",
    ),
    (
        Backend::Sqlite,
        "tenure_jobs",
        "fair_key",
        "a fair job's tenant (NewJob::fair_key), outside the schema for the same reason",
    ),
    (
        Backend::Postgres,
        "tenure_jobs",
        "fair_key",
        "a fair job's tenant (NewJob::fair_key), outside the schema for the same reason",
    ),
    (
        Backend::Mysql,
        "tenure_jobs",
        "fair_key",
        "a fair job's tenant (NewJob::fair_key), outside the schema for the same reason",
    ),
    (
        Backend::Sqlite,
        "tenure_jobs",
        "fair_stamp",
        "a fair job's place among its queue's tenants (claims order by it); tenure_jobs has \
         diesel's 32 columns, and 64 would double every user's diesel build",
    ),
    (
        Backend::Postgres,
        "tenure_jobs",
        "fair_stamp",
        "a fair job's place among its queue's tenants (claims order by it); tenure_jobs has \
         diesel's 32 columns, and 64 would double every user's diesel build",
    ),
    (
        Backend::Mysql,
        "tenure_jobs",
        "fair_stamp",
        "a fair job's place among its queue's tenants (claims order by it); tenure_jobs has \
         diesel's 32 columns, and 64 would double every user's diesel build",
    ),
    (
        Backend::Mysql,
        "tenure_jobs",
        "live_dedup_key",
        "generated (STORED): the dedup key while the job is live, for the unique index that \
         MariaDB/MySQL cannot make partial",
    ),
    (
        Backend::Postgres,
        "tenure_jobs",
        "slot",
        "the job's slot (partition): 0-5 fill in turn and are truncated once retention has \
         deleted their jobs, -1 (`tenure_jobs_kept`) holds the jobs with a dedup key",
    ),
    (
        Backend::Mysql,
        "tenure_limit_keys",
        "admissions",
        "written by every claim under the key's limit, so Galera certifies claims of one key \
         on two nodes as a conflict",
    ),
    (
        Backend::Mysql,
        "tenure_queue_limits",
        "admissions",
        "written by every claim under the queue's limit, for the same reason",
    ),
];

/// Tables a backend has for its storage alone, which `tenure::schema` does not declare (not
/// for applications to read: they hold no more than the contract's tables say).
const BACKEND_INTERNAL_TABLES: &[(Backend, &str, &str)] = &[
    (
        Backend::Postgres,
        "tenure_ready",
        "the ready ring: one entry per waiting job",
    ),
    (
        Backend::Postgres,
        "tenure_ready_0",
        "a slot (partition) of the ready ring",
    ),
    (
        Backend::Postgres,
        "tenure_ready_1",
        "a slot (partition) of the ready ring",
    ),
    (
        Backend::Postgres,
        "tenure_ready_2",
        "a slot (partition) of the ready ring",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_0",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_1",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_2",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_3",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_4",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_5",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_kept",
        "a slot (partition) of tenure_jobs: its jobs are read through tenure_jobs",
    ),
    (
        Backend::Postgres,
        "tenure_jobs_rotation",
        "when the job slots last turned",
    ),
    (
        Backend::Postgres,
        "tenure_ready_ring",
        "the ring's generation and last rotation",
    ),
    (
        Backend::Mysql,
        "tenure_ready",
        "the ready ring: one entry per waiting job (partitions p0..p2 are its slots)",
    ),
    (
        Backend::Mysql,
        "tenure_ready_ring",
        "the ring's generation and last rotation",
    ),
];

/// Tables in a tenure database that are not tenure's.
const IGNORED_TABLES: &[&str] = &["__diesel_schema_migrations"];

/// A column as the database reports it.
#[derive(Debug, Clone, QueryableByName)]
pub(super) struct DbColumn {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(super) t: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(super) c: String,
    /// `YES` or `NO`.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(super) nullable: String,
    /// PostgreSQL: `data_type`; MariaDB: `data_type`; SQLite: the declared type.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(super) ty: String,
    /// MariaDB: `column_type` (with its length or precision); elsewhere `ty` again.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(super) detail: String,
}

pub(super) fn database_columns(conn: &mut AnyConnection, backend: Backend) -> Vec<DbColumn> {
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
pub(super) fn schema_mismatches(
    backend: Backend,
    tables: &[TableSpec],
    db: &[DbColumn],
) -> Vec<String> {
    let mut found = Vec::new();
    for column in db {
        if IGNORED_TABLES.contains(&column.t.as_str())
            || BACKEND_INTERNAL_TABLES
                .iter()
                .any(|&(b, t, _)| b == backend && t == column.t)
        {
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
    for &(b, t, _) in BACKEND_INTERNAL_TABLES {
        if b == backend && !db.iter().any(|col| col.t == t) {
            found.push(format!(
                "{t}: listed as backend-internal, not in the database"
            ));
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

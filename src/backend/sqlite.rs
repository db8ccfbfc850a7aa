//! SQLite: the foundation's SQL and type mappings.

use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use diesel::connection::{AnsiTransactionManager, SimpleConnection, TransactionManager};
use diesel::deserialize::{self, FromSql};
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::{BigInt, Binary, Nullable, Text};
use diesel::sqlite::{Sqlite, SqliteConnection, SqliteValue};
use diesel::{QueryResult, RunQueryDsl};

use super::file_lock::{self, FileLock};
use super::statement::statement;
use super::turns::{self, Turn};
use super::{Dialect, Liveness, LivenessLock, LockSpace, Probe, Rendered, Syntax, Upsert};
use super::{Replication, SessionSetup, Synchronous};
use crate::backend::transaction::bare_write_transaction;
use crate::sql_types::{Instant, SQLITE_INSTANT_FORMAT, Token, token_from_bytes};
use crate::{Result, migrate};

/// The database clock, in the one text layout of [`Instant`].
pub(crate) const NOW: &str = "strftime('%Y-%m-%d %H:%M:%f','now')";

static SYNTAX: Syntax = Syntax {
    now: NOW,
    now_plus_micros: "strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', ? / 1000000.0))",
    // A statement never waits for a lock: the IMMEDIATE transaction has the database's.
    grant_times: "acquired_at = excluded.acquired_at, expires_at = excluded.expires_at",
    upsert: Upsert::OnConflictWhere,
    returning: true,
    for_update: "",
    skip_locked: "",
    random_token: "randomblob(16)",
    notify_lease: None,
    notify_queue: None,
    notify_queue_unflushed: None,
    notify_in_returning: "",
    claim_from: "tenure_jobs AS c INDEXED BY tenure_jobs_claim",
    claim_waiting: " AND c.state = 'waiting'",
    claim_lock: "",
    claim_mark_ids: "id IN {ids}",
    claim_forget: None,
    greatest: "MAX",
    insertion_tiebreak: "rowid",
    window_over: "strftime('%Y-%m-%d %H:%M:%f', finished_at, \
                printf('%+.3f seconds', dedup_window_micros / 1000000.0)) <= {now}",
    lock_ends_with_process: true,
    admission_writes: false,
    in_transaction: "",
    rendered: Rendered::new(),
    fair_waiting_from: "tenure_jobs AS c INDEXED BY tenure_jobs_fair \
                        WHERE c.state = 'waiting' AND c.fair_key IS NOT NULL",
    fair_key_is: "c.fair_key = ? AND c.fair_key = ?",
    claim_kind_from: "tenure_jobs AS c INDEXED BY tenure_jobs_claim_kind",
    ready_entries: None,
    keyed_jobs: "tenure_jobs",
    pick_slot: "0",
    job_slots: false,
};

/// The file of the connection's main database ("" for a private in-memory or temporary one)
/// and its busy timeout in milliseconds.
const WRITE_TARGET: &str = "SELECT (SELECT file FROM pragma_database_list WHERE name = 'main') \
    AS file, (SELECT timeout FROM pragma_busy_timeout) AS timeout";

#[derive(diesel::QueryableByName)]
struct WriteTarget {
    #[diesel(sql_type = Nullable<Text>)]
    file: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    timeout: Option<i64>,
}

impl Dialect for SqliteConnection {
    fn syntax(&self) -> &'static Syntax {
        &SYNTAX
    }

    fn setup_session(&mut self, setup: &SessionSetup) -> QueryResult<()> {
        let synchronous = match setup.synchronous {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        };
        // busy_timeout comes first: switching to WAL takes a lock that another connection
        // may hold at that moment.
        self.batch_execute(&format!(
            "PRAGMA busy_timeout = {}; PRAGMA journal_mode = WAL; PRAGMA synchronous = {}; \
             PRAGMA foreign_keys = ON;",
            setup.busy_timeout.as_millis(),
            synchronous
        ))
    }

    fn begin_write(&mut self) -> QueryResult<()> {
        AnsiTransactionManager::begin_transaction_sql(self, "BEGIN IMMEDIATE")
    }

    fn write_turn(&mut self) -> QueryResult<Option<Turn>> {
        let in_transaction = AnsiTransactionManager::transaction_manager_status_mut(self)
            .transaction_depth()
            .map_or(true, |depth| depth.is_some());
        if in_transaction {
            return Ok(None);
        }
        let target = statement(WRITE_TARGET).get_result::<WriteTarget>(self)?;
        let file = target.file.unwrap_or_default();
        if file.is_empty() {
            return Ok(None);
        }
        // The same patience SQLite has with other processes' writers.
        let timeout = Duration::from_millis(target.timeout.unwrap_or(0).max(0) as u64);
        match turns::for_file(&file).acquire(timeout) {
            Some(turn) => Ok(Some(turn)),
            None => Err(DieselError::DatabaseError(
                DatabaseErrorKind::Unknown,
                Box::new(
                    "database is locked (another connection of this process kept the write \
                     lock for the whole busy timeout)"
                        .to_string(),
                ),
            )),
        }
    }

    fn database_now(&mut self) -> QueryResult<DateTime<Utc>> {
        Ok(
            statement("SELECT strftime('%Y-%m-%d %H:%M:%f','now') AS now")
                .get_result::<super::Now>(self)?
                .now,
        )
    }

    fn migrate(&mut self) -> Result<Vec<String>> {
        // The IMMEDIATE transaction is the lock: a second migrator waits for the first to
        // commit, then finds nothing pending.
        bare_write_transaction(self, "run_migrations", |conn| {
            migrate::run_harness(conn, migrate::SQLITE)
        })
    }

    fn replication(&mut self) -> Result<Replication> {
        Ok(Replication::Standalone)
    }
}

/// The file of the connection's main database; `None` for a private in-memory or temporary
/// one (no other process can use it).
fn main_file(conn: &mut SqliteConnection) -> QueryResult<Option<String>> {
    let target = statement(WRITE_TARGET).get_result::<WriteTarget>(conn)?;
    Ok(target.file.filter(|file| !file.is_empty()))
}

impl Liveness for SqliteConnection {
    fn take_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Option<LivenessLock>> {
        let Some(database) = main_file(self)? else {
            return Ok(Some(LivenessLock::Nowhere));
        };
        if cfg!(not(unix)) {
            return Ok(Some(LivenessLock::Nowhere));
        }
        Ok(FileLock::create(&database, space, id)?.map(LivenessLock::File))
    }

    fn holds_liveness_lock(&mut self, _space: LockSpace, _id: i64) -> Result<bool> {
        // A lock on a file this process keeps open is held until the process ends.
        Ok(true)
    }

    fn probe_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Probe> {
        let Some(database) = main_file(self)? else {
            return Ok(Probe::Unknown);
        };
        if cfg!(not(unix)) {
            return Ok(Probe::Unknown);
        }
        match FileLock::existing(&database, space, id) {
            Ok(Some(lock)) => Ok(Probe::Free(Some(lock))),
            Ok(None) => Ok(Probe::Held),
            // Its worker took it (the file is made before its row commits): someone removed
            // it, or this process names the database by another path. Taken as alive.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Probe::Unknown),
            Err(source) => Err(crate::Error::LockFile {
                path: file_lock::path_of(&database, space, id),
                source,
            }),
        }
    }
}

impl diesel::query_builder::QueryFragment<Sqlite> for crate::sql_types::DatabaseNow {
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, Sqlite>,
    ) -> QueryResult<()> {
        out.push_sql(NOW);
        Ok(())
    }
}

impl FromSql<Instant, Sqlite> for DateTime<Utc> {
    fn from_sql(value: SqliteValue<'_, '_, '_>) -> deserialize::Result<Self> {
        let text = <String as FromSql<Text, Sqlite>>::from_sql(value)?;
        let naive = NaiveDateTime::parse_from_str(&text, "%Y-%m-%d %H:%M:%S%.f")
            .map_err(|e| format!("instant {text:?} is not in tenure's layout: {e}"))?;
        Ok(naive.and_utc())
    }
}

impl ToSql<Instant, Sqlite> for DateTime<Utc> {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Sqlite>) -> serialize::Result {
        out.set_value(self.format(SQLITE_INSTANT_FORMAT).to_string());
        Ok(IsNull::No)
    }
}

impl FromSql<Token, Sqlite> for uuid::Uuid {
    fn from_sql(value: SqliteValue<'_, '_, '_>) -> deserialize::Result<Self> {
        token_from_bytes(&<Vec<u8> as FromSql<Binary, Sqlite>>::from_sql(value)?)
    }
}

impl ToSql<Token, Sqlite> for uuid::Uuid {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Sqlite>) -> serialize::Result {
        <[u8] as ToSql<Binary, Sqlite>>::to_sql(self.as_bytes().as_slice(), out)
    }
}

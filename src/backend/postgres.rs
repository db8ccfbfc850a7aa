//! PostgreSQL: the foundation's SQL and type mappings.

use std::io::Write;

use chrono::{DateTime, Utc};
use diesel::connection::{AnsiTransactionManager, CacheSize, Connection, SimpleConnection};
use diesel::deserialize::{self, FromSql};
use diesel::pg::{Pg, PgConnection, PgValue};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::{BigInt, Binary, Bool, Integer, Text, Timestamptz};
use diesel::{QueryResult, RunQueryDsl};

use super::statement::statement;
use super::{Dialect, Liveness, LivenessLock, LockSpace, Probe, Rendered, Syntax, Upsert};
use super::{Replication, SessionSetup};
use crate::backend::transaction::bare_write_transaction;
use crate::error::DatabaseFailure;
use crate::sql_types::{Instant, Token, token_from_bytes};
use crate::{Result, migrate};

/// The database clock. `now()` is frozen at the start of the transaction, which would make a
/// lease taken late in a long transaction expire early; `clock_timestamp()` is volatile and
/// would keep indexes from serving comparisons. `statement_timestamp()` is neither.
pub(crate) const NOW: &str = "statement_timestamp()";

/// Key of the transaction-level advisory lock that serializes tenure's migrations (advisory
/// locks are per database). The bytes spell "tenure.m".
const MIGRATION_LOCK_KEY: i64 = 0x7465_6e75_7265_2e6d;

static SYNTAX: Syntax = Syntax {
    now: NOW,
    now_plus_micros: "(statement_timestamp() + ? * interval '1 microsecond')",
    // clock_timestamp(), read once, after the wait for the row lock.
    grant_times: "(acquired_at, expires_at) = (SELECT c.t, c.t + (excluded.expires_at - \
        excluded.acquired_at) FROM (SELECT clock_timestamp() AS t) AS c)",
    upsert: Upsert::OnConflictWhere,
    returning: true,
    for_update: " FOR UPDATE",
    skip_locked: " FOR UPDATE SKIP LOCKED",
    random_token: "gen_random_uuid()",
    notify_lease: Some("SELECT pg_notify('tenure_leases', ?)"),
    notify_queue: Some("SELECT pg_notify('tenure_jobs', ?)"),
    notify_queue_unflushed: Some(
        "SELECT set_config('synchronous_commit', 'off', true) AS c, pg_notify('tenure_jobs', ?) AS n",
    ),
    notify_in_returning: ", pg_notify('tenure_jobs', queue)",
    // The ring's entries alone: they carry everything the pick filters and orders by, and
    // the mark locks the jobs (`claim_mark_ids`).
    claim_from: "tenure_ready c",
    claim_waiting: "",
    claim_lock: " FOR UPDATE SKIP LOCKED",
    // `IS TRUE`: a plain `state = 'waiting'` let the planner read the jobs through an index
    // on state (without statistics it guesses a few rows match), every waiting job and dead
    // version of it, instead of the ids' primary key entries (the drain at a third).
    claim_mark_ids: "id = ANY (ARRAY(SELECT id FROM {jobs} WHERE id IN {ids} \
        AND (state = 'waiting') IS TRUE FOR NO KEY UPDATE SKIP LOCKED))",
    claim_forget: Some(
        "WITH marked AS ({marked}), forgotten AS (DELETE FROM tenure_ready \
         WHERE id = ANY (ARRAY(SELECT id FROM marked))) SELECT * FROM marked",
    ),
    greatest: "GREATEST",
    insertion_tiebreak: "name",
    window_over: "finished_at + dedup_window_micros * interval '1 microsecond' <= {now}",
    lock_ends_with_process: false,
    admission_writes: false,
    in_transaction: "",
    rendered: Rendered::new(),
    fair_waiting_from: "tenure_ready c WHERE c.fair_key IS NOT NULL",
    fair_key_is: "c.fair_key >= ? AND c.fair_key <= ?",
    claim_kind_from: "tenure_ready c",
    ready_entries: None,
    keyed_jobs: "tenure_jobs_kept AS tenure_jobs",
    pick_slot: "c.job_slot::bigint",
    job_slots: true,
};

impl Dialect for PgConnection {
    fn syntax(&self) -> &'static Syntax {
        &SYNTAX
    }

    fn setup_session(&mut self, _setup: &SessionSetup) -> QueryResult<()> {
        // timestamptz is an instant whatever the session's time zone, and tenure chooses the
        // isolation of each of its transactions itself. JIT compilation is off: tenure's
        // statements are short, and over tenure_jobs' seven partitions, which are seldom
        // analyzed (without autovacuum never), the planner's estimates of a prune's by-id
        // statements passed JIT's cost thresholds: 340 ms compiling a 1 ms statement.
        self.batch_execute("SET jit = off")
    }

    fn begin_write(&mut self) -> QueryResult<()> {
        AnsiTransactionManager::begin_transaction_sql(self, "BEGIN ISOLATION LEVEL READ COMMITTED")
    }

    fn database_now(&mut self) -> QueryResult<DateTime<Utc>> {
        Ok(statement("SELECT statement_timestamp() AS now")
            .get_result::<super::Now>(self)?
            .now)
    }

    fn migrate(&mut self) -> Result<Vec<String>> {
        // DDL is transactional here: the whole set commits or nothing does, and the lock is
        // released by the commit.
        bare_write_transaction(self, "run_migrations", |conn| {
            statement("SELECT pg_advisory_xact_lock(?)")
                .bind::<BigInt, _>(MIGRATION_LOCK_KEY)
                .execute(conn)?;
            migrate::run_harness(conn, migrate::POSTGRES)
        })
    }

    fn replication(&mut self) -> Result<Replication> {
        // `pg_stat_replication` lists every WAL sender to any user (its details only to
        // privileged ones); the two settings are readable by all.
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            standbys: i64,
            #[diesel(sql_type = Text)]
            names: String,
            #[diesel(sql_type = Text)]
            commit: String,
        }
        let row = statement(
            "SELECT (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming') \
             AS standbys, current_setting('synchronous_standby_names') AS names, \
             current_setting('synchronous_commit') AS commit",
        )
        .get_result::<Row>(self)?;
        let confirmed = !row.names.trim().is_empty()
            && matches!(row.commit.as_str(), "on" | "remote_write" | "remote_apply");
        Ok(match (row.standbys, confirmed) {
            (_, true) => Replication::Synchronous,
            (0, false) => Replication::Standalone,
            (n, false) => Replication::Asynchronous {
                standbys: u32::try_from(n).unwrap_or(u32::MAX),
            },
        })
    }
}

impl diesel::query_builder::QueryFragment<Pg> for crate::sql_types::DatabaseNow {
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, Pg>,
    ) -> QueryResult<()> {
        out.push_sql(NOW);
        Ok(())
    }
}

impl FromSql<Instant, Pg> for DateTime<Utc> {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<Self> {
        <DateTime<Utc> as FromSql<Timestamptz, Pg>>::from_sql(value)
    }
}

impl ToSql<Instant, Pg> for DateTime<Utc> {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        <DateTime<Utc> as ToSql<Timestamptz, Pg>>::to_sql(self, out)
    }
}

impl FromSql<Token, Pg> for uuid::Uuid {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<Self> {
        // A uuid's binary form is its 16 bytes.
        token_from_bytes(&<Vec<u8> as FromSql<Binary, Pg>>::from_sql(value)?)
    }
}

impl ToSql<Token, Pg> for uuid::Uuid {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        out.write_all(self.as_bytes())?;
        Ok(IsNull::No)
    }
}

/// The first key of a liveness lock, `pg_advisory_lock(key1, key2)`, per space: the bytes
/// spell "tenu" (workers) and "tenl" (lease holders). The two-key form is a key space apart
/// from the one-key form (which the migration lock and most applications use), and advisory
/// locks are per database.
fn lock_class(space: LockSpace) -> i32 {
    match space {
        LockSpace::Worker => 0x7465_6e75,
        LockSpace::LeaseHolder => 0x7465_6e6c,
    }
}

/// The second key of lock `id`: its low 32 bits (worker ids are never reused, and four
/// billion workers apart before two could share a key; lease holders' keys are random below
/// 2^31).
fn lock_key(id: i64) -> i32 {
    id as i32
}

#[derive(diesel::QueryableByName)]
struct Got {
    #[diesel(sql_type = Bool)]
    got: bool,
}

impl Liveness for PgConnection {
    fn take_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Option<LivenessLock>> {
        // Session-level: held until the session ends (also if the transaction that took it
        // rolls back), whatever the transactions after it do.
        let got = statement("SELECT pg_try_advisory_lock(?, ?) AS got")
            .bind::<Integer, _>(lock_class(space))
            .bind::<Integer, _>(lock_key(id))
            .get_result::<Got>(self)?
            .got;
        if !got {
            return Ok(None);
        }
        // The session must last as long as its process: not ended by the server for being
        // idle (PostgreSQL 14 and later can; the lock's connection is idle between checks,
        // and for as long as its process is stopped).
        statement(
            "SELECT CASE WHEN CAST(current_setting('server_version_num') AS integer) >= 140000 \
             THEN set_config('idle_session_timeout', '0', false) END AS setting",
        )
        .execute(self)?;
        Ok(Some(LivenessLock::Session))
    }

    fn holds_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<bool> {
        // pg_locks shows each key as an oid; an int4 cast to oid keeps its 32 bits.
        Ok(statement(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
             AND pid = pg_backend_pid() AND classid = CAST(? AS oid) \
             AND objid = CAST(? AS oid) AND objsubid = 2 AND granted) AS got",
        )
        .bind::<Integer, _>(lock_class(space))
        .bind::<Integer, _>(lock_key(id))
        .get_result::<Got>(self)?
        .got)
    }

    fn probe_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Probe> {
        // Taken only if no session holds it (the worker's ended); then held by this
        // transaction until it ends, so the worker cannot take it again meanwhile.
        let free = statement("SELECT pg_try_advisory_xact_lock(?, ?) AS got")
            .bind::<Integer, _>(lock_class(space))
            .bind::<Integer, _>(lock_key(id))
            .get_result::<Got>(self)?
            .got;
        Ok(if free { Probe::Free(None) } else { Probe::Held })
    }
}

/// After PostgreSQL refused a prepared statement because a column it returns changed type
/// (a migration ran meanwhile; MySQL/MariaDB and SQLite prepare again by themselves), forgets
/// every statement this connection prepared, so that the call can be repeated and the next
/// one prepares afresh. Without this, diesel would keep the refused statement and every later
/// call of it on this connection would fail the same way, for the connection's life.
pub(crate) fn forget_stale_plans(conn: &mut PgConnection, result: &impl DatabaseFailure) {
    if !result.is_stale_plan() {
        return;
    }
    tracing::warn!(
        "a column changed type under tenure's prepared statements: preparing them again"
    );
    // Frees them on the server; fails harmlessly inside an aborted transaction (diesel keeps
    // numbering new statements past the old names, so none collides).
    let _ = conn.batch_execute("DEALLOCATE ALL");
    conn.set_prepared_statement_cache_size(CacheSize::Disabled);
    conn.set_prepared_statement_cache_size(CacheSize::Unbounded);
}

/// Starts listening for enqueue notifications on `conn` (a dedicated connection).
pub(crate) fn listen(conn: &mut PgConnection) -> QueryResult<()> {
    diesel::sql_query(format!("LISTEN {}", super::NOTIFY_CHANNEL)).execute(conn)?;
    Ok(())
}

/// The channel on which a lease's release wakes its waiters (the payload is its name).
pub(crate) const LEASE_CHANNEL: &str = "tenure_leases";

/// Starts (`true`) or stops listening for lease releases on `conn`, a caller's connection
/// while it waits in line.
pub(crate) fn listen_leases(conn: &mut PgConnection, on: bool) -> QueryResult<()> {
    let verb = if on { "LISTEN" } else { "UNLISTEN" };
    diesel::sql_query(format!("{verb} {LEASE_CHANNEL}")).execute(conn)?;
    Ok(())
}

/// Whether the server's autovacuum is off: then nothing reclaims the dead row versions that
/// every job leaves in `tenure_jobs` (three a job), and claims slow down as they pile up.
pub(crate) fn autovacuum_is_off(conn: &mut PgConnection) -> QueryResult<bool> {
    #[derive(diesel::QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    let setting = diesel::sql_query("SELECT current_setting('autovacuum') AS value")
        .get_result::<Setting>(conn)?;
    Ok(setting.value == "off")
}

/// The payloads of notifications that arrived since the last call (queues on a worker's
/// listener, lease names on a lease waiter's connection). diesel's iterator
/// does not block (it returns at once when nothing is pending), so callers poll it.
pub(crate) fn notified_queues(conn: &mut PgConnection) -> QueryResult<Vec<String>> {
    conn.notifications_iter()
        .map(|n| n.map(|n| n.payload))
        .collect()
}

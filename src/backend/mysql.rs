//! MySQL/MariaDB: the foundation's SQL and type mappings.

use std::sync::atomic::{AtomicBool, Ordering};

use chrono::{DateTime, NaiveDateTime, Utc};
use diesel::connection::{
    AnsiTransactionManager, CacheSize, Connection, SimpleConnection, TransactionManager,
};
use diesel::deserialize::{self, FromSql};
use diesel::mysql::{Mysql, MysqlConnection, MysqlValue};
use diesel::serialize::{self, Output, ToSql};
use diesel::sql_types::{BigInt, Binary, Datetime, Integer, Nullable};
use diesel::{QueryResult, RunQueryDsl};

use super::statement::statement;
use super::{Dialect, Liveness, LivenessLock, LockSpace, Probe, Rendered, Syntax, Upsert};
use super::{Replication, SessionSetup};
use crate::backend::transaction::require_bare;
use crate::error::DatabaseFailure;
use crate::sql_types::{Instant, Token, token_from_bytes};
use crate::{Error, Result, migrate};

/// The database clock in UTC with microseconds, whatever the session's time zone.
pub(crate) const NOW: &str = "UTC_TIMESTAMP(6)";

/// After a statement failed with a database error, forgets every statement this connection
/// prepared, so that none is executed again. The MariaDB client leaves a prepared statement
/// whose result failed part-way (a locking read chosen as a deadlock's victim after the
/// server had sent the result's head, a lock wait timeout, a killed query) expecting the
/// rest of that result: its next execution reads for it before sending anything, and waits
/// forever while the server waits for a command (issue 32 item 8: a finisher that hung
/// holding its jobs' locks when its transaction ran again after a deadlock). diesel keeps
/// such a statement in its cache; closing it instead is safe. The statements are prepared
/// again as they are next used (one round trip each).
pub(crate) fn forget_failed_statements(conn: &mut MysqlConnection, result: &impl DatabaseFailure) {
    if !matches!(
        result.database_error(),
        Some(diesel::result::Error::DatabaseError(..))
    ) {
        return;
    }
    forget_prepared_statements(conn);
}

/// Drops the connection's prepared statements (diesel keeps no other way to forget them): the
/// next execution of each prepares it anew.
fn forget_prepared_statements(conn: &mut MysqlConnection) {
    conn.set_prepared_statement_cache_size(CacheSize::Disabled);
    conn.set_prepared_statement_cache_size(CacheSize::Unbounded);
}

/// Whether a connection of this process has met a Galera node: from then on, every MySQL
/// transaction tenure commits first asks whether the server still has it open
/// (`Dialect::ended_before_commit`: one round trip). Per process rather than per connection
/// (diesel's connection carries no state of ours); a process that also talks to a lone server
/// pays the question there too, and loses nothing.
static GALERA_NODE_MET: AtomicBool = AtomicBool::new(false);

/// Whether `err` is a Galera node's abort of tenure's transaction reported as a trigger "has an
/// error in its body": an abort that interrupts the loading of `tenure_jobs`' triggers makes
/// the parser report the interruption so ("... 'Query was empty'", or a syntax error at an
/// arbitrary line), at times before the node has rolled the transaction back (so
/// `@@in_transaction` still reads 1). tenure's triggers are its migrations', which parse; only
/// on a Galera node, and only for tenure's own transactions (rolled back by then), is it
/// taken as repeatable.
fn is_abort_in_disguise(err: &Error) -> bool {
    GALERA_NODE_MET.load(Ordering::Relaxed)
        && matches!(
            err,
            Error::Database(diesel::result::Error::DatabaseError(_, info))
                if info.message().contains("has an error in its body")
        )
}

/// How long a migrator waits for another one to finish, in seconds.
const MIGRATION_LOCK_WAIT_SECONDS: i32 = 300;

static SYNTAX: Syntax = Syntax {
    now: NOW,
    now_plus_micros: "(UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
    // Not used: the take is written for ON DUPLICATE KEY UPDATE (see the lease module).
    grant_times: "",
    upsert: Upsert::OnDuplicateKey,
    returning: false,
    for_update: " FOR UPDATE",
    skip_locked: " FOR UPDATE SKIP LOCKED",
    random_token: "RANDOM_BYTES(16)",
    notify_lease: None,
    notify_queue: None,
    notify_queue_unflushed: None,
    notify_in_returning: "",
    // The job by its primary key, pinned: with `j.state` in the pick, the optimizer read
    // the jobs through the stalled-claims index on state, every waiting job (and locked
    // what it read).
    claim_from: "tenure_ready c FORCE INDEX (tenure_ready_claim) \
                 STRAIGHT_JOIN tenure_jobs j FORCE INDEX (PRIMARY) ON j.id = c.id",
    // The ring is exact (its triggers change it with the job, in one transaction), and a
    // locking read sees the job's latest version: a job that no longer waits is never
    // claimed even if it were not (a read of the row the join reads anyway).
    claim_waiting: " AND j.state = 'waiting'",
    claim_lock: " FOR UPDATE SKIP LOCKED",
    claim_mark_ids: "id IN {ids}",
    claim_forget: None,
    greatest: "GREATEST",
    insertion_tiebreak: "name",
    window_over: "finished_at + INTERVAL dedup_window_micros MICROSECOND <= {now}",
    lock_ends_with_process: false,
    admission_writes: true,
    in_transaction: " AND @@in_transaction = 1",
    rendered: Rendered::new(),
    fair_waiting_from: "tenure_ready c FORCE INDEX (tenure_ready_fair) WHERE c.fair_key IS NOT NULL",
    fair_key_is: "c.fair_key = ? AND c.fair_key = ?",
    claim_kind_from: "tenure_ready c FORCE INDEX (tenure_ready_claim_kind) \
                      STRAIGHT_JOIN tenure_jobs j FORCE INDEX (PRIMARY) ON j.id = c.id",
    // One statement a chunk where the trigger did a generation read and an insert a row
    // (10,000 rows in ten inserts: 320-375 ms through the trigger, 236-272 ms passed by plus
    // this; BENCHMARKS.md). The generation is read in the statement, as the trigger reads it: an
    // entry in a slot a rotation has passed is moved by the next one.
    ready_entries: Some(
        "INSERT INTO tenure_ready (slot, id, queue, kind, priority, due_at, limit_key, \
             fair_stamp, fair_key) \
         SELECT (SELECT generation % 3 FROM tenure_ready_ring WHERE one = 1), id, queue, kind, \
             priority, due_at, limit_key, fair_stamp, fair_key \
         FROM tenure_jobs FORCE INDEX (PRIMARY) WHERE id IN {ids} AND state = 'waiting'",
    ),
    keyed_jobs: "tenure_jobs",
    pick_slot: "0",
    job_slots: false,
};

/// What `GET_LOCK` and `RELEASE_LOCK` return: 1 done, 0 timed out, NULL on an error.
#[derive(diesel::QueryableByName)]
struct LockResult {
    #[diesel(sql_type = Nullable<Integer>)]
    got: Option<i32>,
}

impl Dialect for MysqlConnection {
    fn syntax(&self) -> &'static Syntax {
        &SYNTAX
    }

    fn setup_session(&mut self, _setup: &SessionSetup) -> QueryResult<()> {
        // UTC so that any NOW() a user writes beside tenure agrees with tenure's UTC_TIMESTAMP(6);
        // strict mode so that an over-long value is an error, never silently truncated.
        //
        // On a Galera node (MariaDB's executable comment; the variable read from
        // information_schema, which every build has), a transaction that has written and then
        // sat idle for 60 s ends its connection. A node can leave a client waiting for good for
        // the answer to a statement whose transaction the cluster aborted (seen: the server
        // idle, the client blocked in its read), and nothing else would end that wait; the
        // client then gets a lost connection (outcome unknown) instead of hanging.
        self.batch_execute(
            "SET time_zone = '+00:00'; \
             SET SESSION sql_mode = CONCAT_WS(',', NULLIF(@@SESSION.sql_mode, ''), 'STRICT_ALL_TABLES'); \
             /*M!100300 SET SESSION idle_write_transaction_timeout = IF((SELECT COUNT(*) \
                 FROM information_schema.GLOBAL_VARIABLES \
                 WHERE VARIABLE_NAME = 'WSREP_ON' AND VARIABLE_VALUE = 'ON') > 0, 60, \
                 @@SESSION.idle_write_transaction_timeout) */",
        )?;
        if !GALERA_NODE_MET.load(Ordering::Relaxed) {
            let galera = statement(
                "SELECT 0 /*M!100300 + (SELECT COUNT(*) FROM information_schema.GLOBAL_VARIABLES \
                 WHERE VARIABLE_NAME = 'WSREP_ON' AND VARIABLE_VALUE = 'ON') */ AS n",
            )
            .get_result::<crate::rows::Count>(self)?;
            if galera.n > 0 {
                GALERA_NODE_MET.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn begin_write(&mut self) -> QueryResult<()> {
        // The level must be set before BEGIN (it applies to the next transaction only); diesel
        // checks that no transaction is open before sending either.
        AnsiTransactionManager::begin_transaction_sql(
            self,
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN",
        )
    }

    fn transaction_ended_under_us(&mut self) -> bool {
        // The question's own error, when it is the abort's (a node reports one to the next
        // statement, which this may be), says the transaction is gone too.
        let ended = match statement("SELECT @@in_transaction AS n")
            .get_result::<crate::rows::Count>(self)
        {
            Ok(open) => open.n == 0,
            Err(error) => Error::from(error).is_retryable(),
        };
        if ended {
            // The statement that failed may have left its result half-read, and the caller
            // will see `RolledBackUnderUs`, not a database error, so `dispatch!` would not
            // forget it: its next execution would wait for good for the rest of that result.
            forget_prepared_statements(self);
        }
        ended
    }

    fn recover_from_disguised_abort(&mut self, err: &Error) -> bool {
        if !is_abort_in_disguise(err) {
            return false;
        }
        tracing::warn!(error = %err, "a Galera abort reported as a trigger's error: the node reloads tenure_jobs' triggers");
        // Seen: once an abort interrupted their loading, every later statement on the node
        // that fired them failed so (3,000 in a row, on fresh connections too), while the
        // node's other tables went on. A table flushed is opened afresh, its triggers parsed
        // again. Never inside a caller's transaction (a FLUSH commits it); `LOCAL`: this node
        // only; a short lock wait, since it waits for the table's current users. Best effort:
        // without the RELOAD privilege the repeat may meet the error again.
        let in_transaction = AnsiTransactionManager::transaction_manager_status_mut(self)
            .transaction_depth()
            .map_or(true, |depth| depth.is_some());
        if !in_transaction {
            let flushed = self.batch_execute(
                "SET @tenure_lock_wait = @@SESSION.lock_wait_timeout; \
                 SET SESSION lock_wait_timeout = 10; \
                 FLUSH LOCAL TABLES tenure_jobs",
            );
            let restored = self.batch_execute("SET SESSION lock_wait_timeout = @tenure_lock_wait");
            if let Err(e) = flushed.and(restored) {
                tracing::warn!(error = %e, "the node could not reload tenure_jobs' triggers");
            }
        }
        true
    }

    fn ended_before_commit(&mut self) -> QueryResult<bool> {
        if !GALERA_NODE_MET.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let open = statement("SELECT @@in_transaction AS n").get_result::<crate::rows::Count>(self);
        if let Err(error) = &open {
            forget_failed_statements(self, error);
        }
        Ok(open?.n == 0)
    }

    fn database_now(&mut self) -> QueryResult<DateTime<Utc>> {
        Ok(statement("SELECT UTC_TIMESTAMP(6) AS now")
            .get_result::<super::Now>(self)?
            .now)
    }

    fn migrate(&mut self) -> Result<Vec<String>> {
        // DDL commits implicitly, so no transaction can hold the set together: each migration
        // is one DDL statement, and a named lock (per database) serializes migrators.
        require_bare(self, "run_migrations")?;
        let got =
            statement("SELECT GET_LOCK(CONCAT('tenure.migrate.', MD5(DATABASE())), ?) AS got")
                .bind::<Integer, _>(MIGRATION_LOCK_WAIT_SECONDS)
                .get_result::<LockResult>(self)?
                .got;
        if got != Some(1) {
            return Err(Error::Timeout {
                what: "the migration lock (another process is running tenure's migrations)",
            });
        }
        // On Galera the named lock is each node's own: a table made by one node's DDL (which
        // the cluster orders) is the cluster's, so one migrator at a time runs DDL (two
        // nodes racing the same trigger's DDL left one waiting in isolation for good).
        let galera = in_galera_cluster(self)?;
        if galera {
            take_cluster_migration_mutex(self)?;
        }
        let mut outcome = migrate::run_harness(self, migrate::MYSQL);
        // On Galera the named lock is each node's own: a process on another node may be
        // applying the same migrations, and one of two DDL statements on the same table is
        // refused (a deadlock, "already exists"). Every migration can run again from its
        // start (MySQL commits DDL as it goes: each is written so), so the harness runs
        // again, reading afresh what is applied, until the other is done (bounded).
        if outcome.is_err() && galera {
            let until = std::time::Instant::now() + GALERA_MIGRATION_RETRIES_FOR;
            while let Err(e) = &outcome {
                if std::time::Instant::now() >= until || !applied_elsewhere_maybe(e) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(250));
                outcome = migrate::run_harness(self, migrate::MYSQL);
            }
        }
        if galera {
            let _ = statement(DROP_MIGRATION_MUTEX).execute(self);
        }
        let released =
            statement("SELECT RELEASE_LOCK(CONCAT('tenure.migrate.', MD5(DATABASE()))) AS got")
                .get_result::<LockResult>(self);
        let applied = outcome?;
        released?;
        Ok(applied)
    }

    fn replication(&mut self) -> Result<Replication> {
        if in_galera_cluster(self)? {
            return Ok(Replication::Synchronous);
        }
        let binary_log = statement("SHOW VARIABLES LIKE 'log_bin'")
            .load::<Variable>(self)?
            .into_iter()
            .any(|v| v.value.eq_ignore_ascii_case("ON"));
        Ok(if binary_log {
            Replication::Unknown
        } else {
            Replication::Standalone
        })
    }
}

/// How long migrations on a Galera node try again while another node applies them.
const GALERA_MIGRATION_RETRIES_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// Galera's migration mutex: the table exists while one node's migrator runs.
const MAKE_MIGRATION_MUTEX: &str = "CREATE TABLE tenure_migration_mutex (one TINYINT PRIMARY KEY)";
const DROP_MIGRATION_MUTEX: &str = "DROP TABLE IF EXISTS tenure_migration_mutex";
/// A mutex older than this was left by a migrator that died: taken over.
const MIGRATION_MUTEX_AGE: &str = "SELECT CAST(COALESCE(MAX(TIMESTAMPDIFF(SECOND, create_time, NOW())), 0) \
    AS SIGNED) AS n FROM information_schema.tables \
    WHERE table_schema = DATABASE() AND table_name = 'tenure_migration_mutex'";

/// Makes the migration mutex (waiting while another node's migrator holds it, up to
/// [`GALERA_MIGRATION_RETRIES_FOR`]; one older than ten minutes is taken over).
fn take_cluster_migration_mutex(conn: &mut MysqlConnection) -> Result<()> {
    let until = std::time::Instant::now() + GALERA_MIGRATION_RETRIES_FOR;
    loop {
        match statement(MAKE_MIGRATION_MUTEX).execute(conn) {
            Ok(_) => return Ok(()),
            Err(e) if e.to_string().contains("already exists") => {
                let age = statement(MIGRATION_MUTEX_AGE)
                    .get_result::<crate::rows::Count>(conn)?
                    .n;
                if age > 600 {
                    statement(DROP_MIGRATION_MUTEX).execute(conn)?;
                    continue;
                }
            }
            Err(e) => {
                let error = Error::from(e);
                if !error.is_retryable() {
                    return Err(error);
                }
            }
        }
        if std::time::Instant::now() >= until {
            return Err(Error::Timeout {
                what: "the migration mutex (another node is running tenure's migrations)",
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Whether a migration's error may come from another node applying the same migration at
/// once: a conflict (retryable) or a statement that found its work done ("already exists",
/// "Duplicate ...", "Can't DROP ...; check that it exists"). diesel gives no MySQL error number,
/// so the server's message decides.
fn applied_elsewhere_maybe(error: &Error) -> bool {
    let text = error.to_string();
    error.is_retryable()
        || [
            "already exists",
            "Duplicate",
            "check that",
            "try restarting transaction",
        ]
        .iter()
        .any(|part| text.contains(part))
}

/// The name of lock `?` of a space: `tenure.w.` (workers) or `tenure.l.` (lease holders).
/// Named locks are server-wide, so the database's digest keeps the locks of two databases
/// apart; at most 64 characters (MySQL's limit), whatever the database's name: 9 + 32 + 1 +
/// at most 20 for the id.
fn lock_name(space: LockSpace) -> &'static str {
    match space {
        LockSpace::Worker => "CONCAT('tenure.w.', MD5(DATABASE()), '.', ?)",
        LockSpace::LeaseHolder => "CONCAT('tenure.l.', MD5(DATABASE()), '.', ?)",
    }
}

#[derive(diesel::QueryableByName)]
struct Flag {
    #[diesel(sql_type = BigInt)]
    flag: i64,
}

impl Liveness for MysqlConnection {
    fn take_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Option<LivenessLock>> {
        // Held by this session until it ends (or RELEASE_LOCK); a wait of 0: no blocking.
        let got = statement(format!("SELECT GET_LOCK({}, 0) AS got", lock_name(space)))
            .bind::<BigInt, _>(id)
            .get_result::<LockResult>(self)?
            .got;
        if got != Some(1) {
            return Ok(None);
        }
        // The session must last as long as its process: not ended by the server after
        // `wait_timeout` idle (8 hours by default; the lock's connection is idle between
        // checks, and for as long as its process is stopped). A year is the most it takes.
        statement("SET SESSION wait_timeout = 31536000").execute(self)?;
        Ok(Some(LivenessLock::Session))
    }

    fn holds_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<bool> {
        let held = statement(format!(
            "SELECT CAST(COALESCE(IS_USED_LOCK({}) = CONNECTION_ID(), 0) AS SIGNED) AS flag",
            lock_name(space)
        ))
        .bind::<BigInt, _>(id)
        .get_result::<Flag>(self)?
        .flag;
        Ok(held == 1)
    }

    fn probe_liveness_lock(&mut self, space: LockSpace, id: i64) -> Result<Probe> {
        // A look that takes nothing: the worker (or lease holder) may take its lock again right
        // after it, and is then judged by its heartbeat and by how long its lock was found
        // free (see `jobs::queue::rescue`), or renews (see `lease::liveness`).
        let free = statement(format!(
            "SELECT CAST(IS_USED_LOCK({}) IS NULL AS SIGNED) AS flag",
            lock_name(space)
        ))
        .bind::<BigInt, _>(id)
        .get_result::<Flag>(self)?
        .flag;
        if free != 1 {
            return Ok(Probe::Held);
        }
        // In a Galera cluster a named lock is the node's own: a lease holder's lock taken on
        // another node looks free here, and a grant would shorten a living holder's lease
        // (its renewals come every ttl/3; its checks, on its own node, find the lock held).
        // Nothing can be told there: its ttl alone ends it. (A worker is judged by its
        // heartbeat as well, which replicates.)
        if space == LockSpace::LeaseHolder && in_galera_cluster(self)? {
            return Ok(Probe::Unknown);
        }
        Ok(Probe::Free(None))
    }
}

#[derive(diesel::QueryableByName)]
struct Variable {
    #[diesel(sql_type = diesel::sql_types::Text)]
    #[diesel(column_name = Value)]
    value: String,
}

/// Whether this server is a node of a Galera cluster (`wsrep_on`; MySQL has no such variable,
/// and `SHOW VARIABLES` then returns no row).
pub(crate) fn in_galera_cluster(conn: &mut MysqlConnection) -> Result<bool> {
    let on = statement("SHOW VARIABLES LIKE 'wsrep_on'")
        .load::<Variable>(conn)?
        .into_iter()
        .any(|v| v.value.eq_ignore_ascii_case("ON"));
    Ok(on)
}

impl diesel::query_builder::QueryFragment<Mysql> for crate::sql_types::DatabaseNow {
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, Mysql>,
    ) -> QueryResult<()> {
        out.push_sql(NOW);
        Ok(())
    }
}

impl FromSql<Instant, Mysql> for DateTime<Utc> {
    fn from_sql(value: MysqlValue<'_>) -> deserialize::Result<Self> {
        Ok(<NaiveDateTime as FromSql<Datetime, Mysql>>::from_sql(value)?.and_utc())
    }
}

impl ToSql<Instant, Mysql> for DateTime<Utc> {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Mysql>) -> serialize::Result {
        let naive = self.naive_utc();
        <NaiveDateTime as ToSql<Datetime, Mysql>>::to_sql(&naive, &mut out.reborrow())
    }
}

impl FromSql<Token, Mysql> for uuid::Uuid {
    fn from_sql(value: MysqlValue<'_>) -> deserialize::Result<Self> {
        token_from_bytes(&<Vec<u8> as FromSql<Binary, Mysql>>::from_sql(value)?)
    }
}

impl ToSql<Token, Mysql> for uuid::Uuid {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Mysql>) -> serialize::Result {
        <[u8] as ToSql<Binary, Mysql>>::to_sql(self.as_bytes().as_slice(), out)
    }
}

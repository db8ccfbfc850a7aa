//! Fast takeover at its edges, across processes (docs/leases.md, "Fast takeover"): a refused
//! take keeps a dead holder's lock file for the next look; clean releases leave no lock
//! file; a file named by another path; a stopped holder whose idle sessions the server would
//! end. Found by an attack on the first version (the ones that failed then say so).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use tenure::lease::{Take, Wait};
use tenure::{AnyConnection, Backend, Error, LeaseGuard, Pool};

use crate::child::spawn;
use crate::common::{TestDb, concrete, placeholders};
use crate::leaders::stop_outside_a_transaction;
use crate::takeover::held_fence;

#[cfg(feature = "sqlite")]
mod sqlite {
    #[test]
    fn a_refused_take_leaves_a_dead_holders_lock_file_for_the_next_take() {
        super::a_refused_take_leaves_a_dead_holders_lock_file_for_the_next_take()
    }
    #[test]
    fn release_on_then_exit_leaves_no_lock_file() {
        super::release_on_then_exit_leaves_no_lock_file()
    }
    #[test]
    fn a_holder_naming_the_file_by_a_relative_path_is_seen_alive_through_a_symlink() {
        super::a_holder_naming_the_file_by_a_relative_path_is_seen_alive_through_a_symlink()
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    #[test]
    fn a_stopped_holder_whose_idle_sessions_the_server_ends_keeps_its_lease_until_its_ttl() {
        super::a_stopped_holder_whose_idle_sessions_the_server_ends_keeps_its_lease_until_its_ttl()
    }
}

/// Child: a `pooled-holder` run from directory `dir`, naming the database by `url` (relative).
pub fn pooled_holder_in(dir: &str, url: &str, name: &str, ttl_secs: &str) {
    std::env::set_current_dir(dir).expect("chdir");
    crate::takeover::pooled_holder(url, name, ttl_secs);
}

/// Child: takes `name` from a pool, releases it cleanly with `release_on` on a bare pooled
/// connection, and exits at once.
pub fn release_on_exit(url: &str, name: &str) {
    let pool = Pool::options().max_size(2).open(url).expect("pool");
    let guard = LeaseGuard::try_take_pooled(&pool, name, Duration::from_secs(60), "child")
        .expect("take")
        .expect("free");
    let mut conn = pool.get().expect("conn");
    let released = guard.release_on(&mut conn).expect("release_on");
    std::process::exit(if released { 0 } else { 3 });
}

#[derive(QueryableByName, Debug)]
struct Slot {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    #[allow(dead_code)]
    slot: i32,
    #[diesel(sql_type = tenure::sql_types::Instant)]
    expires_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<BigInt>)]
    held_by: Option<i64>,
    #[diesel(sql_type = Text)]
    holder: String,
}

fn slots(conn: &mut AnyConnection, backend: Backend, name: &str) -> Vec<Slot> {
    let sql = format!(
        "SELECT slot, expires_at, held_by, holder FROM tenure_leases WHERE name = {} ORDER BY slot",
        placeholders(backend, 1)
    );
    concrete!(conn, c => diesel::sql_query(&sql).bind::<Text, _>(name).load(c)).expect("slots")
}

fn lock_dir(db: &TestDb) -> PathBuf {
    PathBuf::from(format!("{}-lease-holders", db.url()))
}

fn files_in(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Guards against: on SQLite the taker's look deletes a dead holder's lock file before its grant
/// commits; when that grant then fails (here a typed LeaseHoldersMismatch for a bad `holders`)
/// the shortening rolls back but the file stays deleted, so every later look says "unknown"
/// and the dead holder keeps its slot until its ttl (600 s) instead of at once.
fn a_refused_take_leaves_a_dead_holders_lock_file_for_the_next_take() {
    let backend = Backend::Sqlite;
    let db = TestDb::migrated(backend);
    let ttl = Duration::from_secs(600);
    let name = "pair";
    let mut holder = spawn("pooled-holder-n", &[db.url(), name, "600", "2"]);
    held_fence(&mut holder);
    let mut conn = db.connect();
    // The other slot, held by a live caller (no guard).
    let _other = Take::new(name, ttl, "other")
        .holders(2)
        .on(&mut conn)
        .unwrap()
        .expect("slot 1 is free");
    let key = slots(&mut conn, backend, name)
        .into_iter()
        .find(|s| s.holder == "child")
        .and_then(|s| s.held_by)
        .expect("the child's slot records its key");
    let file = lock_dir(&db).join(key.to_string());
    assert!(file.exists(), "the child's lock file {file:?}");
    holder.signal("KILL");
    let _ = holder.child.wait();

    // A caller with the wrong number of holders: a typed error, which must change nothing.
    let refused = Take::new(name, ttl, "wrong").holders(3).on(&mut conn);
    assert!(
        matches!(refused, Err(Error::LeaseHoldersMismatch { .. })),
        "{refused:?}"
    );
    let file_after_refusal = file.exists();

    let pool = db.pool(2);
    let started = Instant::now();
    let taken = LeaseGuard::take_pooled_as(
        &pool,
        &Take::new(name, ttl, "taker")
            .holders(2)
            .wait(Wait::up_to(Duration::from_secs(20))),
    )
    .unwrap();
    assert!(
        taken.is_some(),
        "the SIGKILLed holder's slot was not taken over within {:.1?} (ttl 600 s); its lock \
         file still exists after the refused take: {file_after_refusal}; slots now: {:?}",
        started.elapsed(),
        slots(&mut conn, backend, name)
    );
}

/// Guards against: `release_on` returns before the renewal thread dropped the holder lock, so a
/// process that exits right after a clean `release_on` leaves its lock file beside the
/// SQLite database.
fn release_on_then_exit_leaves_no_lock_file() {
    let db = TestDb::migrated(Backend::Sqlite);
    for round in 0..20 {
        let name = format!("clean-{round}");
        let mut child = spawn("release-on-exit", &[db.url(), &name]);
        let status = child.child.wait().unwrap();
        assert!(
            status.success(),
            "round {round}: the child released cleanly: {status:?}"
        );
        let info = tenure::lease::inspect(&mut db.connect(), &name).unwrap();
        assert!(
            info.is_some_and(|i| !i.held),
            "round {round}: taken and released"
        );
        let left = files_in(&lock_dir(&db));
        assert!(
            left.is_empty(),
            "round {round}: a clean release_on left lock files beside the database: {left:?} in {:?}",
            lock_dir(&db)
        );
    }
}

/// A holder that runs in the database's directory and names it `tenure-test.db`, and a taker
/// that names it through a symlinked directory: the taker must see the live holder as alive
/// (never granted), and the dead one as dead (granted within seconds). (Passes.)
fn a_holder_naming_the_file_by_a_relative_path_is_seen_alive_through_a_symlink() {
    let backend = Backend::Sqlite;
    let db = TestDb::migrated(backend);
    let dir = Path::new(db.url()).parent().unwrap().to_path_buf();
    let file = Path::new(db.url())
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let links = tempfile::tempdir().unwrap();
    let link = links.path().join("d");
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let taker_url = link.join(&file).display().to_string();
    let name = "paths";
    let mut holder = spawn(
        "pooled-holder-in",
        &[&dir.display().to_string(), &file, name, "600"],
    );
    held_fence(&mut holder);
    let pool = Pool::options().max_size(2).open(&taker_url).unwrap();
    let ttl = Duration::from_secs(600);
    for _ in 0..5 {
        assert!(
            LeaseGuard::take_pooled_as(&pool, &Take::new(name, ttl, "taker"))
                .unwrap()
                .is_none(),
            "granted while the holder lives"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    holder.signal("KILL");
    let _ = holder.child.wait();
    let started = Instant::now();
    let taken = LeaseGuard::take_pooled_as(
        &pool,
        &Take::new(name, ttl, "taker").wait(Wait::up_to(Duration::from_secs(20))),
    )
    .unwrap();
    assert!(
        taken.is_some(),
        "not taken over in {:.1?}",
        started.elapsed()
    );
}

/// Guards against (PostgreSQL, `idle_session_timeout` set on the database, as operators do to reap
/// idle clients; MariaDB's `wait_timeout` does the same by default after 8 h): a SIGSTOPped
/// holder's liveness lock session is ended by the server for idleness, so the lease is taken
/// over ~10 s later, long before its 24 s ttl — the paused holder did not die. (Found by an
/// attack: the lock's session now turns `idle_session_timeout` off.)
fn a_stopped_holder_whose_idle_sessions_the_server_ends_keeps_its_lease_until_its_ttl() {
    use diesel::connection::SimpleConnection;
    let backend = Backend::Postgres;
    let db = TestDb::migrated(backend);
    let db_name = url::Url::parse(db.url())
        .unwrap()
        .path()
        .trim_start_matches('/')
        .to_string();
    db.connect()
        .batch_execute(&format!(
            "ALTER DATABASE {db_name} SET idle_session_timeout = '3s'"
        ))
        .unwrap();
    let name = "stopped";
    // A ttl of 24 s: idle sessions end after 3 s, a takeover would come 10 s later.
    let mut holder = spawn("pooled-holder", &[db.url(), name, "24"]);
    held_fence(&mut holder);
    stop_outside_a_transaction(holder.child.id(), &mut db.connect(), backend, name);
    let before = slots(&mut db.connect(), backend, name)
        .into_iter()
        .next()
        .expect("the holder's slot");
    let stopped = Instant::now();
    let pool = db.pool(2);
    let taker = LeaseGuard::take_pooled_as(
        &pool,
        &Take::new(name, Duration::from_secs(60), "taker")
            .wait(Wait::up_to(Duration::from_secs(45)).poll_interval(Duration::from_millis(200))),
    )
    .unwrap()
    .expect("granted at the latest once the stopped holder's ttl ran out");
    let after = stopped.elapsed();
    holder.signal("CONT");
    assert!(
        taker.lease().acquired_at() >= before.expires_at,
        "a stopped (living) holder was taken over {after:.1?} after SIGSTOP: granted at {}, \
         before the holder's expiry {}",
        taker.lease().acquired_at(),
        before.expires_at
    );
}

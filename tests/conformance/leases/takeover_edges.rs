//! Fast takeover at its edges, in one process (docs/leases.md, "Fast takeover"): released
//! guards and dropped pools leave nothing open; a hung or slow lock check never holds up the
//! renewals or the release; N-holder leases, a campaign in line, a lock connection killed
//! alone; long SQLite file names and bad input. Found by an attack on the first version (the
//! ones that failed then say so).

use std::time::{Duration, Instant};

use tenure::lease::{self, Take};
use tenure::{Backend, LeaseGuard};

use crate::common::proxy::TestProxy;
use crate::common::{TestDb, on_servers};

on_servers!(
    slow_lock_checks_never_hold_up_the_renewals,
    a_holder_whose_lock_connection_alone_is_killed_keeps_its_lease,
    a_guard_dropped_while_its_lock_check_hangs_still_releases_its_lease,
    without_fast_takeover_a_holder_whose_sessions_are_killed_keeps_its_lease,
    a_dead_slot_of_a_lease_of_three_is_taken_over_and_the_living_slots_are_not,
    a_candidate_whose_kept_lock_was_killed_while_in_line_leads_with_a_live_lock,
    a_released_guard_and_its_dropped_pool_leave_no_connection_or_lock_behind,
);

/// Guards against (bac2c62 kept released guards' liveness locks for reuse this way): after a
/// pooled guard is released and its pool dropped, the process still holds the lock's
/// dedicated connection, its advisory lock, and (through the lock's clone of the pool) the
/// pool's connections, until it exits.
fn a_released_guard_and_its_dropped_pool_leave_no_connection_or_lock_behind(backend: Backend) {
    let db = TestDb::migrated(backend);
    {
        let pool = db.pool(2);
        let guard =
            LeaseGuard::take_pooled_as(&pool, &Take::new("gone", Duration::from_secs(60), "me"))
                .unwrap()
                .expect("free");
        assert!(guard.release().unwrap());
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut control = db.connect();
    let key = held_by(&mut control, "gone");
    let (sessions, lock_held) = match backend {
        Backend::Postgres => (
            crate::common::count(
                &mut control,
                "SELECT COUNT(*) AS n FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            ),
            crate::common::count(
                &mut control,
                &format!(
                    "SELECT COUNT(*) AS n FROM pg_locks WHERE locktype = 'advisory' \
                     AND classid = 1952804460 AND objid = {key} AND objsubid = 2 AND granted \
                     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
            ),
        ),
        _ => (
            crate::common::count(
                &mut control,
                "SELECT CAST(COUNT(*) AS SIGNED) AS n FROM information_schema.processlist \
                 WHERE db = DATABASE() AND id <> CONNECTION_ID()",
            ),
            crate::common::count(
                &mut control,
                &format!(
                    "SELECT CAST(IS_USED_LOCK(CONCAT('tenure.l.', MD5(DATABASE()), '.', {key})) \
                     IS NOT NULL AS SIGNED) AS n"
                ),
            ),
        ),
    };
    assert_eq!(
        (sessions, lock_held),
        (0, 0),
        "after the guard was released and its pool dropped: (other sessions of the test \
         database, whether the released guard's lease-holder lock {key} is still held)"
    );
}

/// A pool whose two connections are opened now, before `proxy` is armed (so they stay fast).
fn warm_pool(proxy: &TestProxy) -> tenure::Pool {
    let pool = tenure::Pool::options()
        .max_size(2)
        .connection_timeout(Duration::from_secs(30))
        .open(&proxy.url)
        .unwrap();
    let a = pool.get().unwrap();
    let b = pool.get().unwrap();
    drop((a, b));
    pool
}

/// Guards against: the renewal thread runs the lock check inline, so while a check hangs (a half-open
/// connection: here the link of the lock's connection alone stops passing data) dropping the
/// guard gives up after RELEASE_WAIT and never releases, though the renewal connection is
/// healthy: the lease stays held in the database (ttl 600 s), its lock session and the
/// renewal thread stay open.
fn a_guard_dropped_while_its_lock_check_hangs_still_releases_its_lease(backend: Backend) {
    let db = TestDb::migrated(backend);
    let proxy = TestProxy::start(db.url(), backend);
    let pool = warm_pool(&proxy);
    proxy.arm_slow(Duration::ZERO);
    let ttl = Duration::from_secs(600);
    let guard = LeaseGuard::take_pooled_as(&pool, &Take::new("hung", ttl, "holder"))
        .unwrap()
        .expect("free");
    proxy.freeze();
    // A check is due every second: let one start and hang.
    std::thread::sleep(Duration::from_secs(2));
    let dropping = Instant::now();
    drop(guard);
    let dropped_in = dropping.elapsed();
    let mut conn = db.connect();
    let until = Instant::now() + Duration::from_secs(10);
    let mut info = lease::inspect(&mut conn, "hung").unwrap().unwrap();
    while info.held && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
        info = lease::inspect(&mut conn, "hung").unwrap().unwrap();
    }
    assert!(
        !info.held,
        "dropped (drop took {dropped_in:.1?}) while its lock check hung: 10 s later the lease \
         is still held in the database, until {} (now {})",
        info.expires_at, info.now
    );
}

/// `fast_takeover(false)`: a holder whose sessions are all killed is not taken over before its
/// ttl (no holder lock, `held_by` NULL). (Passes.)
fn without_fast_takeover_a_holder_whose_sessions_are_killed_keeps_its_lease(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let ttl = Duration::from_secs(600);
    let holder = LeaseGuard::take_pooled_as(
        &pool,
        &Take::new("nofast", ttl, "holder").fast_takeover(false),
    )
    .unwrap()
    .expect("free");
    let mut control = db.connect();
    assert_eq!(
        held_by(&mut control, "nofast"),
        0,
        "no holder lock recorded"
    );
    super::takeover::kill_other_sessions(&mut control, backend);
    let mut taker = db.connect();
    let until = Instant::now() + Duration::from_secs(13);
    while Instant::now() < until {
        assert!(
            lease::try_take(&mut taker, "nofast", ttl, "taker")
                .unwrap()
                .is_none()
        );
        assert!(holder.is_held());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(holder.release().unwrap());
}

/// A lease of three holders: the lock session of one slot's guard is killed and that guard
/// is dropped without a release reaching the database (its pool is cut) while the other two
/// live: a waiting taker gets the dead slot within about 10 s, never a living one, and the
/// living guards stay held. (Passes.)
fn a_dead_slot_of_a_lease_of_three_is_taken_over_and_the_living_slots_are_not(backend: Backend) {
    let db = TestDb::migrated(backend);
    let ttl = Duration::from_secs(600);
    let take = |who: &str| Take::new("three", ttl, who).holders(3);
    let live_pool = db.pool(4);
    let a = LeaseGuard::take_pooled_as(&live_pool, &take("a"))
        .unwrap()
        .unwrap();
    let proxy = TestProxy::start(db.url(), backend);
    let dead_pool = tenure::Pool::options()
        .max_size(2)
        .connection_timeout(Duration::from_secs(2))
        .open(&proxy.url)
        .unwrap();
    let dead = LeaseGuard::take_pooled_as(&dead_pool, &take("dead"))
        .unwrap()
        .unwrap();
    let c = LeaseGuard::take_pooled_as(&live_pool, &take("c"))
        .unwrap()
        .unwrap();
    let dead_slot = dead.lease().slot();
    proxy.cut();
    let started = Instant::now();
    let taker_pool = db.pool(2);
    let taken = LeaseGuard::take_pooled_as(
        &taker_pool,
        &take("taker").wait(lease::Wait::up_to(Duration::from_secs(40))),
    )
    .unwrap()
    .expect("the dead slot taken over");
    assert!(
        !dead.is_held(),
        "the cut-off guard says lost before the grant"
    );
    assert_eq!(taken.lease().slot(), dead_slot);
    assert!(a.is_held() && c.is_held());
    eprintln!(
        "{backend:?}: dead slot taken over in {:.1?}",
        started.elapsed()
    );
    drop(dead);
}

/// A candidate in line keeps its holder lock between campaign steps; its sessions are killed
/// meanwhile; once the leader resigns it is elected, and a third party trying for 13 s never
/// takes the lease from it (its grant records a lock that is held). (Passes.)
fn a_candidate_whose_kept_lock_was_killed_while_in_line_leads_with_a_live_lock(backend: Backend) {
    use tenure::lease::Leadership;
    let db = TestDb::migrated(backend);
    let ttl = Duration::from_secs(600);
    let pool_a = db.pool(2);
    let a = Leadership::campaign(&pool_a, "lead", ttl, "a", None).unwrap();
    assert!(a.wait_elected(Duration::from_secs(10)));
    let proxy = TestProxy::start(db.url(), backend);
    let pool_b = tenure::Pool::options()
        .max_size(2)
        .open(&proxy.url)
        .unwrap();
    let b = Leadership::campaign(&pool_b, "lead", ttl, "b", None).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    proxy.kill_all();
    std::thread::sleep(Duration::from_millis(300));
    a.resign();
    assert!(b.wait_elected(Duration::from_secs(20)));
    let mut taker = db.connect();
    let until = Instant::now() + Duration::from_secs(13);
    while Instant::now() < until {
        assert!(
            lease::try_take(&mut taker, "lead", ttl, "c")
                .unwrap()
                .is_none(),
            "a third party took the lease from a living leader"
        );
        assert!(b.is_leader(), "the living leader lost its lease");
        std::thread::sleep(Duration::from_millis(200));
    }
    b.resign();
}

/// Guards against: a lock check that takes ≥ 1 s (a slow link to the server) starves every renewal
/// (the thread checks again at once after each check), so a holder whose renewals would
/// succeed says "lost" at 0.9 ttl and the database lets the lease lapse at its ttl.
fn slow_lock_checks_never_hold_up_the_renewals(backend: Backend) {
    let db = TestDb::migrated(backend);
    let proxy = TestProxy::start(db.url(), backend);
    // Two fast pool connections, kept idle: the guard's renewals use one of them.
    let pool = warm_pool(&proxy);
    // From now on new connections are slow: the holder lock's dedicated one.
    proxy.arm_slow(Duration::from_millis(1200));
    let ttl = Duration::from_secs(6);
    let guard = LeaseGuard::take_pooled_as(&pool, &Take::new("slow", ttl, "holder"))
        .unwrap()
        .expect("free");
    let taken = Instant::now();
    let mut conn = db.connect();
    let until = taken + Duration::from_secs(15);
    while Instant::now() < until {
        let info = lease::inspect(&mut conn, "slow").unwrap().unwrap();
        assert!(
            guard.is_held() && info.held,
            "{:.1?} after the take (ttl {ttl:?}, renewals every 2 s on a fast connection): \
             guard held {}, database says held {} (expires_at {}, now {})",
            taken.elapsed(),
            guard.is_held(),
            info.held,
            info.expires_at,
            info.now
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(guard.release().unwrap());
}

/// Kills only the session that holds the holder lock (not the renewal connection): the guard
/// takes its lock again and keeps its lease; a taker polling meanwhile never wins. (Passes.)
fn a_holder_whose_lock_connection_alone_is_killed_keeps_its_lease(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let ttl = Duration::from_secs(600);
    let holder = LeaseGuard::take_pooled_as(&pool, &Take::new("lockonly", ttl, "holder"))
        .unwrap()
        .expect("free");
    let mut control = db.connect();
    let key = held_by(&mut control, "lockonly");
    let killed = kill_lock_session(&mut control, backend, key);
    assert!(killed, "found and killed the holder lock's session");
    let mut taker = db.connect();
    let until = Instant::now() + Duration::from_secs(16);
    while Instant::now() < until {
        assert!(
            lease::try_take(&mut taker, "lockonly", ttl, "taker")
                .unwrap()
                .is_none(),
            "the taker was granted a lease whose holder lives"
        );
        assert!(holder.is_held(), "the holder lost a lease nobody took");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(holder.release().unwrap());
}

pub(super) fn held_by(conn: &mut tenure::AnyConnection, name: &str) -> i64 {
    let sql = format!(
        "SELECT CAST(COALESCE(MAX(held_by), 0) AS {}) AS n FROM tenure_leases WHERE name = '{name}'",
        match conn_backend(conn) {
            Backend::Mysql => "SIGNED",
            _ => "BIGINT",
        }
    );
    crate::common::count(conn, &sql)
}

fn conn_backend(conn: &mut tenure::AnyConnection) -> Backend {
    use tenure::TenureConnection;
    conn.backend()
}

/// Kills the session that holds lease-holder lock `key` in this test's database.
pub(super) fn kill_lock_session(
    conn: &mut tenure::AnyConnection,
    backend: Backend,
    key: i64,
) -> bool {
    use diesel::connection::SimpleConnection;
    let session = match backend {
        Backend::Postgres => crate::common::count(
            conn,
            &format!(
                "SELECT CAST(COALESCE(MAX(pid), 0) AS BIGINT) AS n FROM pg_locks \
                 WHERE locktype = 'advisory' AND classid = 1952804460 AND objid = {key} \
                 AND objsubid = 2 AND granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ),
        ),
        Backend::Mysql => crate::common::count(
            conn,
            &format!(
                "SELECT CAST(COALESCE(IS_USED_LOCK(CONCAT('tenure.l.', MD5(DATABASE()), '.', {key})), 0) AS SIGNED) AS n"
            ),
        ),
        Backend::Sqlite => unreachable!(),
    };
    if session == 0 {
        return false;
    }
    match backend {
        Backend::Postgres => {
            crate::common::count(
                conn,
                &format!("SELECT CAST(COUNT(pg_terminate_backend({session})) AS BIGINT) AS n"),
            );
        }
        _ => conn
            .batch_execute(&format!("KILL CONNECTION {session}"))
            .expect("kill"),
    }
    true
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    /// Guards against: the holder lock's file is `<database>-lease-holders/<key>`, so on a database
    /// whose file name is 242-247 bytes long (one SQLite itself opens, with its
    /// `-journal`, `-wal` and `-shm` files) `<name>-lease-holders` is longer
    /// than a file name may be, and every guard from a pool fails to take the lease
    /// (`try_take_pooled` worked on that database before fast takeover, and works with
    /// `fast_takeover(false)`).
    #[test]
    fn a_guard_from_a_pool_on_a_database_with_a_long_file_name_takes_the_lease() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("d".repeat(245)).display().to_string();
        let pool = tenure::Pool::options().max_size(2).open(&url).unwrap();
        tenure::run_migrations(&mut pool.get().unwrap()).unwrap();
        let ttl = Duration::from_secs(60);
        let without = LeaseGuard::take_pooled_as(
            &pool,
            &Take::new("long-off", ttl, "me").fast_takeover(false),
        );
        assert!(matches!(without, Ok(Some(_))), "{without:?}");
        let with = LeaseGuard::take_pooled_as(&pool, &Take::new("long-on", ttl, "me"));
        assert!(matches!(with, Ok(Some(_))), "{with:?}");
    }

    /// Bad input to a pooled take: a typed error, and nothing is left beside the database (no
    /// lock file, no directory). (Passes.)
    #[test]
    fn bad_input_to_a_pooled_take_leaves_nothing_beside_the_database() {
        let db = TestDb::migrated(Backend::Sqlite);
        let pool = db.pool(2);
        let ttl = Duration::from_secs(60);
        let bad = [
            Take::new("", ttl, "me"),
            Take::new("x", Duration::ZERO, "me"),
            Take::new("x", ttl, "me").holders(0),
            Take::new("x", ttl, "me").holders(1001),
            Take::new(&"n".repeat(300), ttl, "me"),
        ];
        for take in &bad {
            let outcome = LeaseGuard::take_pooled_as(&pool, take);
            assert!(
                matches!(outcome, Err(tenure::Error::InvalidInput { .. })),
                "{take:?}: {outcome:?}"
            );
        }
        let dir = std::path::PathBuf::from(format!("{}-lease-holders", db.url()));
        assert!(!dir.exists(), "{dir:?} left behind");
        let mut conn = db.connect();
        assert!(lease::list(&mut conn).unwrap().is_empty());
    }
}

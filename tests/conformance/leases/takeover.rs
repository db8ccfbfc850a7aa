//! Fast takeover, in one process, where a session can end while its process lives (the
//! servers; on SQLite a holder's lock is a file lock, which nothing but the end of its
//! process frees: the process-level scenarios in `faults::takeover` cover all three):
//!
//! - a holder cut off from the database (its sessions end, it cannot connect again) counts
//!   its lease as lost before anyone else is granted it, and the lease is taken over within
//!   a minute although its ttl is ten;
//! - a holder whose connections are killed once takes its lock again, renews, and keeps its
//!   lease: a taker trying meanwhile, longer than a takeover takes, never gets it.

use std::time::{Duration, Instant};

use tenure::lease::{self, Take, Wait};
use tenure::{AnyConnection, Backend, LeaseGuard};

use crate::common::proxy::TestProxy;
use crate::common::{TestDb, count, on_servers};

on_servers!(
    a_holder_cut_off_from_the_database_knows_it_lost_before_anyone_is_granted,
    a_holder_whose_connections_are_killed_takes_its_lock_again_and_keeps_its_lease,
);

/// Far beyond the test's waits: a takeover at the end of the ttl would fail it.
const TTL: Duration = Duration::from_secs(600);

/// Ends every session of this test's database but `conn`'s own: all of the holder's
/// connections, its liveness lock's included. Returns how many it ended.
pub(super) fn kill_other_sessions(conn: &mut AnyConnection, backend: Backend) -> i64 {
    use diesel::connection::SimpleConnection;
    match backend {
        Backend::Postgres => count(
            conn,
            "SELECT COUNT(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        ),
        Backend::Mysql => {
            #[derive(diesel::QueryableByName)]
            struct Id {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                id: i64,
            }
            use diesel::RunQueryDsl;
            let ids: Vec<Id> = diesel::sql_query(
                "SELECT CAST(id AS SIGNED) AS id FROM information_schema.processlist \
                 WHERE db = DATABASE() AND id <> CONNECTION_ID()",
            )
            .load(conn)
            .expect("the sessions");
            for Id { id } in &ids {
                // Gone meanwhile is fine.
                let _ = conn.batch_execute(&format!("KILL CONNECTION {id}"));
            }
            ids.len() as i64
        }
        Backend::Sqlite => unreachable!("SQLite has no sessions"),
    }
}

/// The guard's deadline is an instant: if it were later than the grant, the guard would
/// still say "held" right after the taker's grant returned.
fn a_holder_cut_off_from_the_database_knows_it_lost_before_anyone_is_granted(backend: Backend) {
    let db = TestDb::migrated(backend);
    for round in 0..2 {
        let name = format!("cut-{round}");
        let proxy = TestProxy::start(db.url(), backend);
        let holder_pool = tenure::Pool::options()
            .max_size(2)
            .connection_timeout(Duration::from_secs(2))
            .open(&proxy.url)
            .unwrap();
        let holder = LeaseGuard::take_pooled_as(&holder_pool, &Take::new(&name, TTL, "holder"))
            .unwrap()
            .expect("free");
        assert!(holder.is_held());
        proxy.cut();
        let taker_pool = db.pool(2);
        let wait = Wait::up_to(Duration::from_secs(60)).poll_interval(Duration::from_millis(50));
        let cut_at = Instant::now();
        let taken =
            LeaseGuard::take_pooled_as(&taker_pool, &Take::new(&name, TTL, "taker").wait(wait))
                .unwrap();
        let holder_still_held = holder.is_held();
        let taker = taken.expect("taken over within a minute, not at the end of the ttl");
        assert!(
            !holder_still_held,
            "round {round}: the taker was granted while the holder still counted it held"
        );
        assert!(taker.fence() > holder.fence());
        eprintln!(
            "{backend:?}: taken over {:.1?} after the cut",
            cut_at.elapsed()
        );
        drop(holder);
    }
}

/// Killed once, able to connect again: the guard takes its lock again and renews at once, so
/// the grant a taker's look shortened is renewed before it lapses. The taker polls for longer
/// than a takeover takes and never wins; the holder holds throughout and releases at the end.
fn a_holder_whose_connections_are_killed_takes_its_lock_again_and_keeps_its_lease(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let holder_pool = db.pool(2);
    let holder = LeaseGuard::take_pooled_as(&holder_pool, &Take::new("kept", TTL, "holder"))
        .unwrap()
        .expect("free");
    let mut control = db.connect();
    assert!(kill_other_sessions(&mut control, backend) >= 1);
    let mut taker = db.connect();
    let until = Instant::now() + Duration::from_secs(16);
    let mut tries = 0;
    while Instant::now() < until {
        tries += 1;
        assert!(
            lease::try_take(&mut taker, "kept", TTL, "taker")
                .unwrap()
                .is_none(),
            "try {tries}: the taker was granted a lease whose holder lives"
        );
        assert!(
            holder.is_held(),
            "try {tries}: the holder lost a lease nobody took"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(holder.release().unwrap(), "still the holder's");
}

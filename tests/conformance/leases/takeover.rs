//! Fast takeover, in one process: a guard whose sessions end (its connections killed, as a
//! server restart or a network cut would) counts its lease as lost before anyone else is
//! granted it, and the lease is taken over within seconds, not at the end of its ttl. Only
//! on the servers: on SQLite a holder's lock is a file lock, which nothing but the end of
//! its process frees (the process-level scenarios in `faults::takeover` cover all three).

use std::time::Duration;

use tenure::lease::{Take, Wait};
use tenure::{AnyConnection, Backend, LeaseGuard};

use crate::common::{TestDb, count};

#[cfg(feature = "postgres")]
mod postgres {
    #[test]
    fn a_holder_whose_connections_are_killed_knows_it_lost_before_anyone_is_granted() {
        super::a_holder_whose_connections_are_killed_knows_it_lost_before_anyone_is_granted(
            tenure::Backend::Postgres,
        )
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    #[test]
    fn a_holder_whose_connections_are_killed_knows_it_lost_before_anyone_is_granted() {
        super::a_holder_whose_connections_are_killed_knows_it_lost_before_anyone_is_granted(
            tenure::Backend::Mysql,
        )
    }
}

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

/// The holder's process lives, its sessions end: the guard must say "lost" before the taker
/// is granted (checked right after the grant: the guard's deadline is an instant, so if it
/// were later than the grant the guard would still say "held"), and the taker must be granted
/// within a minute although the ttl is ten.
fn a_holder_whose_connections_are_killed_knows_it_lost_before_anyone_is_granted(backend: Backend) {
    let db = TestDb::migrated(backend);
    for round in 0..2 {
        let name = format!("cut-{round}");
        let holder_pool = db.pool(2);
        let holder = LeaseGuard::take_pooled_as(&holder_pool, &Take::new(&name, TTL, "holder"))
            .unwrap()
            .expect("free");
        assert!(holder.is_held());
        let mut control = db.connect();
        assert!(kill_other_sessions(&mut control, backend) >= 1);
        let taker_pool = db.pool(2);
        let wait = Wait::up_to(Duration::from_secs(60)).poll_interval(Duration::from_millis(50));
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
        assert!(
            !holder.release().unwrap(),
            "the holder's release changes nothing"
        );
        assert!(taker.is_held());
        drop(taker);
    }
}

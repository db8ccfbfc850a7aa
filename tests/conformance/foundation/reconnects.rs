//! A pool whose server was away connects again soon after it is back: an outage as long as a
//! PostgreSQL failover (13 s measured with Patroni, `clusters::patroni`) costs no more than
//! the outage and about a second.

use std::time::{Duration, Instant};

use tenure::{Backend, Pool};

use crate::common::proxy::TestProxy;
use crate::common::{TestDb, on_servers};

on_servers!(a_pool_connects_again_within_seconds_of_the_servers_return);

/// The pool's connection is cut and new ones refused for 14 s, while a caller keeps asking
/// for one; once the proxy lets them through again, a connection comes within 5 s. r2d2
/// alone doubles its pause between attempts up to half the connection timeout (15 s by
/// default): its attempts after the first failure came 0.4, 1.2, 2.8, 6.0, 12.4 and 25.2 s
/// later, the next one about 11 s after the return (`Pool` caps the pause at 1 s). One
/// connection, so that one chain of attempts decides.
fn a_pool_connects_again_within_seconds_of_the_servers_return(backend: Backend) {
    let db = TestDb::migrated(backend);
    let proxy = TestProxy::start(db.url(), backend);
    let pool = Pool::options()
        .max_size(1)
        .connection_timeout(Duration::from_secs(30))
        .open(&proxy.url)
        .expect("a pool");
    drop(pool.get().expect("a connection before the outage"));
    proxy.cut();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(14) {
        // Each failed attempt is one the pool paused before; the caller gives up after 1 s.
        let got = pool
            .r2d2()
            .get_timeout(Duration::from_secs(1))
            .map(|mut conn| {
                diesel::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), &mut *conn)
            });
        assert!(
            !matches!(got, Ok(Ok(_))),
            "a query passed while the proxy refused every connection"
        );
    }
    proxy.restore();
    let back = Instant::now();
    let mut conn = pool.get().expect("a connection after the outage");
    let waited = back.elapsed();
    diesel::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), &mut *conn).expect("a query");
    assert!(
        waited < Duration::from_secs(5),
        "{backend}: the pool connected again {waited:?} after the server was back"
    );
}

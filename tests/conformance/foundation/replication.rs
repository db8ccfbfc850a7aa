//! What `tenure::replication` reads of a lone server: nothing replicates from it (the clusters'
//! answers are checked in `clusters::patroni` and `clusters::galera`).

use tenure::{Backend, Replication};

use crate::common::{TestDb, conformance};

conformance!(a_lone_server_is_standalone);

/// The test servers have no standby (PostgreSQL) and no binary log (MariaDB); SQLite never
/// replicates.
fn a_lone_server_is_standalone(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    assert_eq!(
        tenure::replication(&mut conn).unwrap(),
        Replication::Standalone,
        "{backend}"
    );
}

//! A crash of the Patroni primary while its standbys lag (`scripts/cluster-postgres
//! pause-replication`): what asynchronous replication loses of what tenure acknowledged, and
//! that synchronous replication loses nothing (the cluster and its variables: `patroni.rs`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenure::AnyConnection;
use tenure::jobs::{self, NewJob};

use super::patroni::{ClusterDb, Killed, node_of};
use super::{cluster_script, replication_is_synchronous};

/// The standbys fall behind (the primary's WAL senders stopped: a slow link to them), a client
/// enqueues 20 jobs and takes a lease, and the primary dies before they catch up. With
/// asynchronous replication the primary acknowledged all of it and the promoted standby has
/// none of it: the enqueues are lost and the lease's next grant repeats the fence the lost
/// grant had (the figure; this is what `tenure::replication` and the workers' warning are
/// for). With synchronous replication no commit returns while no standby confirms it: nothing
/// is acknowledged, so nothing acknowledged is lost, and fences grow.
#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_crash_while_the_standbys_lag() {
    let synchronous = replication_is_synchronous();
    let db = ClusterDb::new();
    let mut conn = AnyConnection::connect(&db.url).expect("the primary");
    let mut first = tenure::lease::try_take(&mut conn, "fenced", Duration::from_secs(60), "a")
        .unwrap()
        .expect("free");
    first.release(&mut conn).unwrap();
    // Both standbys have replayed everything so far (the database, the first grant).
    let deadline = Instant::now() + Duration::from_secs(30);
    while crate::common::count(
        &mut conn,
        "SELECT count(*) AS n FROM pg_stat_replication WHERE replay_lsn >= pg_current_wal_lsn()",
    ) < 2
    {
        assert!(Instant::now() < deadline, "the standbys never caught up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let primary = node_of(&mut conn);
    drop(conn);

    cluster_script("cluster-postgres", &["pause-replication"]);
    let acknowledged: Arc<Mutex<(Vec<i64>, Vec<i64>)>> = Arc::default();
    let client = {
        let (url, acknowledged) = (db.url.clone(), acknowledged.clone());
        std::thread::spawn(move || {
            let mut conn = AnyConnection::connect(&url).expect("the primary");
            for n in 0..20 {
                let job = NewJob::new("lag", "k", format!("{n}").into_bytes());
                match jobs::enqueue(&mut conn, &job) {
                    Ok(enqueued) => acknowledged.lock().unwrap().0.push(enqueued.id),
                    Err(_) => return,
                }
            }
            if let Ok(Some(lease)) =
                tenure::lease::try_take(&mut conn, "fenced", Duration::from_secs(60), "b")
            {
                acknowledged.lock().unwrap().1.push(lease.fence());
            }
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    let killed = Killed::node(primary);
    client.join().expect("the client panicked");

    // The new primary takes writes (60 s at most), then: what it has of what was acknowledged.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut conn, next) = loop {
        let granted = AnyConnection::connect(&db.url).and_then(|mut conn| {
            let lease = tenure::lease::try_take(&mut conn, "fenced", Duration::from_secs(60), "c")?;
            Ok((conn, lease))
        });
        match granted {
            Ok((conn, Some(lease))) => break (conn, lease.fence()),
            Ok((_, None)) => panic!("the lease is held: the lost grant's holder's?"),
            Err(e) => {
                assert!(Instant::now() < deadline, "no primary took writes: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    assert_ne!(node_of(&mut conn), primary, "the primary did not change");
    let (ids, fences) = acknowledged.lock().unwrap().clone();
    let missing = ids
        .iter()
        .filter(|id| jobs::get(&mut conn, **id).expect("read a job").is_none())
        .count();
    let repeated: Vec<i64> = fences.iter().copied().filter(|f| *f >= next).collect();
    drop(conn);
    drop(killed);
    eprintln!(
        "Patroni ({}), the primary killed while its standbys lagged: {} enqueues and {} grant \
         acknowledged; {missing} enqueues missing afterwards; the next grant's fence {next} \
         (repeated: {repeated:?})",
        if synchronous {
            "synchronous"
        } else {
            "asynchronous"
        },
        ids.len(),
        fences.len(),
    );
    if synchronous {
        assert!(
            ids.is_empty() && fences.is_empty(),
            "a commit returned unconfirmed"
        );
        assert_eq!(next, 2, "the fence after the first grant");
    } else {
        assert_eq!(
            ids.len(),
            20,
            "the primary acknowledged without its standbys"
        );
        assert_eq!(missing, 20, "what the promoted standby never received");
        assert_eq!(repeated, vec![2], "the lost grant's fence, granted again");
    }
}

//! A PostgreSQL cluster of three nodes managed by Patroni (`scripts/cluster-postgres start`; the
//! multi-host URL that follows the primary in `TENURE_TEST_PATRONI_URL`, and
//! `TENURE_TEST_PATRONI_SYNC=1` when it was started with synchronous replication). Each test
//! runs an enqueuer, a worker, a lease taker and a lease guard through the multi-host URL,
//! forces a failover (a switchover, or SIGKILL of the primary) and counts: every acknowledged
//! enqueue present and run, fences strictly increasing, the guard still held, everything
//! resumed by itself. Failovers disturb every client of the cluster: these tests run one at a
//! time (`scripts/test-clusters` gives them one thread).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobState, NewJob};
use tenure::lease::{Take, Wait};
use tenure::worker::{JobContext, Worker};
use tenure::{AnyConnection, LeaseGuard, Pool, Replication};

use super::{cluster_script, replication_is_synchronous};

/// A private database on the cluster, reached through the multi-host URL.
pub(super) struct ClusterDb {
    pub(super) url: String,
    name: String,
    admin_url: String,
}

impl ClusterDb {
    pub(super) fn new() -> ClusterDb {
        let admin_url = std::env::var("TENURE_TEST_PATRONI_URL").unwrap_or_else(|_| {
            panic!(
                "TENURE_TEST_PATRONI_URL is unset: run scripts/test-clusters, which starts the \
                 cluster (scripts/cluster-postgres) and sets it"
            )
        });
        let name = format!("tenure_p_{}", uuid::Uuid::new_v4().simple());
        AnyConnection::connect(&admin_url)
            .expect("the cluster's primary")
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create the test database");
        // A multi-host URL is not one `url::Url` parses: its database is the path after the
        // hosts, before the query.
        let (hosts, query) = admin_url.split_once('?').unwrap_or((&admin_url, ""));
        let (hosts, _) = hosts.rsplit_once('/').expect("a URL with a database");
        let url = format!("{hosts}/{name}?{query}");
        // libpq tries the hosts in order and gives up at a standby that does not have the
        // database yet ("does not exist" is not a reason to try the next host): wait until
        // every node replayed its creation.
        for node in 1..=3 {
            let node_url = format!("postgres://root@127.0.0.1:{}/{name}", 25440 + node);
            let deadline = Instant::now() + Duration::from_secs(30);
            while AnyConnection::connect(&node_url).is_err() {
                assert!(Instant::now() < deadline, "node {node} never had {name}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        tenure::run_migrations(&mut AnyConnection::connect(&url).expect("the primary"))
            .expect("migrations");
        ClusterDb {
            url,
            name,
            admin_url,
        }
    }

    fn pool(&self, size: u32) -> Pool {
        Pool::options()
            .max_size(size)
            .connection_timeout(Duration::from_secs(60))
            .open(&self.url)
            .expect("a pool")
    }
}

impl Drop for ClusterDb {
    fn drop(&mut self) {
        if let Ok(mut admin) = AnyConnection::connect(&self.admin_url) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

/// The node (1..3) whose PostgreSQL serves this connection (its port is 25440 + N).
pub(super) fn node_of(conn: &mut AnyConnection) -> u16 {
    #[derive(diesel::QueryableByName)]
    struct Port {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        port: i32,
    }
    let port: Port = diesel::RunQueryDsl::get_result(
        diesel::sql_query("SELECT inet_server_port() AS port"),
        conn,
    )
    .expect("the server's port");
    u16::try_from(port.port - 25440).expect("a node's port")
}

/// Kills node `n` (SIGKILL: a crash) and starts it again when dropped, whatever the test did
/// meanwhile: the next test finds three nodes.
pub(super) struct Killed(u16);

impl Killed {
    pub(super) fn node(n: u16) -> Killed {
        cluster_script("cluster-postgres", &["kill", &n.to_string()]);
        Killed(n)
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        cluster_script("cluster-postgres", &["restart", &self.0.to_string()]);
    }
}

/// What the load saw.
#[derive(Default)]
struct Seen {
    /// Acknowledged enqueues: payload number -> job id.
    acknowledged: BTreeMap<u64, i64>,
    /// Enqueues whose outcome is unknown (the connection died under them).
    unknown: u64,
    /// When each acknowledged enqueue returned, since the start.
    enqueued_at: Vec<Duration>,
    /// Fences of acknowledged grants, in grant order.
    fences: Vec<i64>,
    /// Job ids run by the worker, and when each run ended, since the start.
    runs: Vec<(i64, Duration)>,
    /// Whether the guard with fast takeover and the one with its ttl alone were still held
    /// at the end.
    guards_held: (bool, bool),
}

/// A guard held from before the failover to the end, and a taker waiting for its lease on
/// another pool all along. The taker may be granted the lease only once the guard said it lost
/// it: never while the guard believes it holds it.
struct HeldThroughout {
    name: &'static str,
    guard: Arc<Mutex<LeaseGuard>>,
    _guard_pool: Pool,
    waiter_pool: Pool,
    waiter: std::thread::JoinHandle<Option<(LeaseGuard, bool)>>,
}

impl HeldThroughout {
    fn take(db: &ClusterDb, name: &'static str, take: Take) -> HeldThroughout {
        let guard_pool = db.pool(2);
        let guard = Arc::new(Mutex::new(
            LeaseGuard::take_pooled_as(&guard_pool, &take)
                .expect("take")
                .expect("free"),
        ));
        let waiter_pool = db.pool(2);
        let (pool, holder) = (waiter_pool.clone(), guard.clone());
        let waiter = std::thread::spawn(move || {
            loop {
                let wait = Take::new(name, Duration::from_secs(30), "waiter")
                    .wait(Wait::up_to(Duration::from_secs(3)));
                if let Ok(Some(granted)) = LeaseGuard::take_pooled_as(&pool, &wait) {
                    // Read right after the grant: a guard that still believes it holds the lease
                    // would be a second holder.
                    return Some((granted, holder.lock().unwrap().is_held()));
                }
                let told_to_stop = pool.get().is_ok_and(|mut conn| {
                    tenure::lease::inspect(&mut conn, &format!("{name}-stop"))
                        .is_ok_and(|l| l.is_some())
                });
                if told_to_stop {
                    return None;
                }
            }
        });
        HeldThroughout {
            name,
            guard,
            _guard_pool: guard_pool,
            waiter_pool,
            waiter,
        }
    }

    /// Stops the waiter; says whether the guard still holds its lease (and releases it).
    fn end(self) -> bool {
        let mut conn = self.waiter_pool.get().expect("a connection");
        tenure::lease::try_take(
            &mut conn,
            &format!("{}-stop", self.name),
            Duration::from_secs(600),
            "test",
        )
        .expect("take")
        .expect("free");
        drop(conn);
        let waited = self.waiter.join().expect("the waiter panicked");
        if let Some((_, guard_held)) = &waited {
            assert!(
                !guard_held,
                "{}: the waiter was granted the lease while its guard believed it held it",
                self.name
            );
        }
        let held = self.guard.lock().unwrap().is_held();
        assert!(
            !(held && waited.is_some()),
            "{}: the waiter was granted the lease and the guard still holds it",
            self.name
        );
        if held {
            let guard = Arc::try_unwrap(self.guard)
                .unwrap_or_else(|_| panic!("the waiter ended"))
                .into_inner()
                .unwrap();
            assert!(guard.release().expect("release"), "{}: release", self.name);
        }
        held
    }
}

enum Failover {
    /// `scripts/cluster-postgres failover`: a planned switchover to a standby.
    Switchover,
    /// SIGKILL of the primary's Patroni and PostgreSQL; the node is restarted afterwards.
    KillPrimary,
}

/// Runs the load for a few seconds, forces `failover`, runs it until enqueues, runs and grants
/// flowed again for a few seconds, stops it and waits until the worker ran every acknowledged
/// job. Returns what was seen and the longest pause of acknowledged enqueues and of runs from
/// the failover on.
fn under_load(db: &ClusterDb, failover: Failover) -> (Seen, Duration, Duration) {
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();

    let worker_seen = seen.clone();
    let worker = Worker::builder(db.pool(6))
        .queue("f")
        .threads(2)
        .poll_interval(Duration::from_millis(50))
        .claim_ttl(Duration::from_secs(30))
        .raw_handler("k", move |ctx: &JobContext, _payload: &[u8]| {
            worker_seen
                .lock()
                .unwrap()
                .runs
                .push((ctx.id, start.elapsed()));
            Ok(())
        })
        .start()
        .expect("a worker");

    let enqueuer = {
        let (pool, seen, stop) = (db.pool(2), seen.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let outcome = pool.get().and_then(|mut conn| {
                    jobs::enqueue(
                        &mut conn,
                        &NewJob::new("f", "k", n.to_string().into_bytes()),
                    )
                });
                match outcome {
                    Ok(enqueued) => {
                        let mut seen = seen.lock().unwrap();
                        seen.acknowledged.insert(n, enqueued.id);
                        seen.enqueued_at.push(start.elapsed());
                    }
                    Err(e) => {
                        if e.is_outcome_unknown() {
                            seen.lock().unwrap().unknown += 1;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };

    // One grant after another, each released before the next: their fences must grow.
    let taker = {
        let (pool, seen, stop) = (db.pool(2), seen.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let granted = pool.get().and_then(|mut conn| {
                    let lease = tenure::lease::try_take(
                        &mut conn,
                        "turns",
                        Duration::from_secs(3),
                        "taker",
                    )?;
                    if let Some(mut lease) = lease {
                        seen.lock().unwrap().fences.push(lease.fence());
                        lease.release(&mut conn)?;
                    }
                    Ok(())
                });
                if granted.is_err() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    // Guards held throughout, each with a taker waiting for its lease on another pool.
    let fast = HeldThroughout::take(
        db,
        "held-fast",
        Take::new("held-fast", Duration::from_secs(30), "guard"),
    );
    let by_ttl = HeldThroughout::take(
        db,
        "held-ttl",
        Take::new("held-ttl", Duration::from_secs(60), "guard").fast_takeover(false),
    );

    std::thread::sleep(Duration::from_secs(4));
    let primary = node_of(&mut AnyConnection::connect(&db.url).expect("the primary"));
    let forced_at = start.elapsed();
    let killed = match failover {
        Failover::Switchover => {
            cluster_script("cluster-postgres", &["failover"]);
            None
        }
        Failover::KillPrimary => Some(Killed::node(primary)),
    };
    // Load goes on until enqueues and runs flowed for 4 s after the failover (60 s at most).
    let flowing = |seen: &Seen| {
        let last_enqueue = seen.enqueued_at.last().copied().unwrap_or_default();
        let runs_after = seen.runs.iter().filter(|(_, at)| *at > forced_at).count();
        let first_after = seen.enqueued_at.iter().find(|at| **at > forced_at).copied();
        first_after.is_some_and(|first| last_enqueue > first + Duration::from_secs(4))
            && runs_after > 20
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    while !flowing(&seen.lock().unwrap()) {
        assert!(
            Instant::now() < deadline,
            "enqueues and runs did not flow again within 90 s of the failover"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let now_primary = node_of(&mut AnyConnection::connect(&db.url).expect("the new primary"));
    assert_ne!(now_primary, primary, "the primary did not change");
    drop(killed);

    stop.store(true, Ordering::SeqCst);
    let stopped_at = start.elapsed();
    enqueuer.join().expect("the enqueuer panicked");
    taker.join().expect("the taker panicked");
    let fast_held = fast.end();
    let ttl_held = by_ttl.end();
    seen.lock().unwrap().guards_held = (fast_held, ttl_held);

    // Every acknowledged job is there and runs (the worker goes on through the failover).
    let acknowledged: BTreeSet<i64> = seen
        .lock()
        .unwrap()
        .acknowledged
        .values()
        .copied()
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ran: BTreeSet<i64> = seen.lock().unwrap().runs.iter().map(|r| r.0).collect();
        if acknowledged.is_subset(&ran) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    worker.shutdown(Duration::from_secs(10));

    let seen = Arc::try_unwrap(seen)
        .unwrap_or_else(|_| panic!("every thread ended"))
        .into_inner()
        .unwrap();
    let enqueue_pause = longest_pause(&seen.enqueued_at, forced_at);
    // While the load ran: afterwards only the jobs whose claims were lost are left to run.
    let mut ran_at: Vec<Duration> = seen
        .runs
        .iter()
        .map(|(_, at)| *at)
        .filter(|at| *at <= stopped_at)
        .collect();
    ran_at.sort();
    let run_pause = longest_pause(&ran_at, forced_at);
    (seen, enqueue_pause, run_pause)
}

/// The longest time between two successive instants of `at` (sorted) that ends after `from`.
fn longest_pause(at: &[Duration], from: Duration) -> Duration {
    at.windows(2)
        .filter(|w| w[1] > from)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default()
}

/// What was lost: acknowledged enqueues missing now, or present but never run; fences that did
/// not grow.
fn losses(seen: &Seen, url: &str) -> (Vec<u64>, Vec<u64>, Vec<(i64, i64)>) {
    let mut conn = None;
    for _ in 0..50 {
        match AnyConnection::connect(url) {
            Ok(c) => {
                conn = Some(c);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    let mut conn = conn.expect("the primary");
    let mut missing = Vec::new();
    let mut unrun = Vec::new();
    let ran: BTreeSet<i64> = seen.runs.iter().map(|r| r.0).collect();
    for (n, id) in &seen.acknowledged {
        match jobs::get(&mut conn, *id).expect("read a job") {
            Some(job) if job.payload == n.to_string().into_bytes() => {
                if !ran.contains(id) || job.state != JobState::Completed {
                    unrun.push(*n);
                }
            }
            _ => missing.push(*n),
        }
    }
    let repeated = seen
        .fences
        .windows(2)
        .filter(|w| w[1] <= w[0])
        .map(|w| (w[0], w[1]))
        .collect();
    (missing, unrun, repeated)
}

fn check(failover: Failover, what: &str) {
    let synchronous = replication_is_synchronous();
    let warnings = crate::common::show_warnings();
    let db = ClusterDb::new();
    // What the crate reads of the cluster, and what a pool says of it when it opens.
    let replication =
        tenure::replication(&mut AnyConnection::connect(&db.url).expect("the primary")).unwrap();
    if synchronous {
        assert_eq!(replication, Replication::Synchronous);
    } else {
        assert_eq!(replication, Replication::Asynchronous { standbys: 2 });
    }
    let (seen, enqueue_pause, run_pause) = under_load(&db, failover);
    let (missing, unrun, repeated) = losses(&seen, &db.url);
    let runs = seen.runs.len();
    // Jobs that waited for a rescue: a claim that committed while its answer was lost (the
    // connection died with the old primary) holds the job until the claim lapses.
    let first_run: BTreeMap<i64, Duration> =
        seen.runs.iter().rev().map(|(id, at)| (*id, *at)).collect();
    let late = seen
        .acknowledged
        .values()
        .zip(&seen.enqueued_at)
        .filter(|(id, at)| {
            first_run
                .get(id)
                .is_some_and(|run| *run > **at + Duration::from_secs(10))
        })
        .count();
    let distinct: BTreeSet<i64> = seen.runs.iter().map(|r| r.0).collect();
    eprintln!(
        "Patroni ({}), {what}: {} acknowledged enqueues ({} outcome unknown), {runs} runs of \
         {} jobs, {} grants; no acknowledged enqueue for {:.1} s, no run for {:.1} s; missing {}, \
         not run {}, fences not growing {}; {late} jobs first ran over 10 s after their \
         enqueue; the guard with fast takeover {}, the guard by its \
         ttl (60 s) {}",
        if synchronous {
            "synchronous"
        } else {
            "asynchronous"
        },
        seen.acknowledged.len(),
        seen.unknown,
        distinct.len(),
        seen.fences.len(),
        enqueue_pause.as_secs_f64(),
        run_pause.as_secs_f64(),
        missing.len(),
        unrun.len(),
        repeated.len(),
        if seen.guards_held.0 { "held" } else { "lost" },
        if seen.guards_held.1 { "held" } else { "lost" },
    );
    assert!(
        seen.guards_held.1,
        "the guard whose ttl outlasts the failover lost its lease"
    );
    assert!(unrun.is_empty(), "acknowledged jobs never run: {unrun:?}");
    let warned = warnings.values_of_field("standbys");
    if synchronous {
        assert!(
            warned.is_empty(),
            "a pool warned of asynchronous standbys: {warned:?}"
        );
    } else {
        assert!(
            warned.contains("2"),
            "no pool warned of the asynchronous standbys"
        );
    }
    if synchronous {
        assert!(
            missing.is_empty(),
            "acknowledged enqueues lost: {missing:?}"
        );
        assert!(repeated.is_empty(), "fences repeated: {repeated:?}");
    }
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_switchover_under_load_loses_nothing_acknowledged() {
    check(Failover::Switchover, "switchover");
}

#[test]
#[ignore = "needs a Patroni cluster: scripts/test-clusters"]
fn patroni_a_killed_primary_under_load_loses_nothing_acknowledged() {
    check(Failover::KillPrimary, "primary killed");
}

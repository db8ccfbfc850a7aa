//! Leader election across processes: three candidate processes campaign for one lease while
//! the leader is SIGKILLed and the next one SIGSTOPped past its ttl. Every leader writes only
//! inside a transaction that verified its term (`Leadership::verify`), so the log of writes,
//! in insertion order, shows who led when: fences never go back (no two leaders' writes
//! interleave), a new leader is elected after each kill and pause, and the paused leader,
//! continued, writes nothing more.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::BigInt;
use tenure::lease::Leadership;
use tenure::{Backend, Pool};

use crate::child::{report, spawn, sql};
use crate::common::{TestDb, conformance, count};
use crate::processes::{exec, sqlite_write_lock_free};

conformance!(leaders_killed_and_paused_never_overlap);

/// The candidates' lease ttl: a killed or paused leader is replaced after about twice this
/// (its expiry, then the leadership's lock delay of one ttl).
const TTL: Duration = Duration::from_secs(1);

/// A candidate process: campaigns until killed; while it leads, writes (fence, pid) to
/// `leader_log` every 20 ms, each in a transaction that verified its term. Reports `leading
/// F` at the first write of each term and `refused` when a write found its term over.
pub fn candidate(url: &str) {
    let pool = Pool::options().max_size(4).open(url).expect("pool");
    let backend = pool.backend();
    let pid = std::process::id() as i64;
    let me = Leadership::campaign(&pool, "leader", TTL, &pid.to_string(), None).expect("campaign");
    let mut conn = pool.get().expect("conn");
    let mut reported = 0;
    let until = Instant::now() + Duration::from_secs(300);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
        let Some(fence) = me.fence() else { continue };
        let wrote = tenure::transaction(&mut conn, |conn| {
            me.verify(conn)?;
            diesel::sql_query(sql(
                backend,
                "INSERT INTO leader_log (fence, pid) VALUES (?, ?)",
            ))
            .bind::<BigInt, _>(fence)
            .bind::<BigInt, _>(pid)
            .execute(&mut **conn)
            .map_err(tenure::Error::from)
        });
        match wrote {
            Ok(_) if fence != reported => {
                reported = fence;
                report(format!("leading {fence}"));
            }
            Ok(_) => {}
            Err(e) if e.is_lease_lost() => report("refused"),
            Err(e) => report(format!("error {e}")),
        }
    }
}

/// Stops process `pid` (SIGSTOP) so that it is frozen outside any transaction on lease
/// `name`'s rows: one stopped inside a transaction that verified or renewed the lease holds
/// them until it continues, and nobody can be granted the lease meanwhile (what `verify`
/// promises). Continues and stops it again until then.
pub(crate) fn stop_outside_a_transaction(
    pid: u32,
    conn: &mut tenure::AnyConnection,
    backend: Backend,
    name: &str,
) {
    signal(pid, "STOP");
    let mut tries = 0;
    while !lease_row_free(conn, backend, name) {
        tries += 1;
        assert!(tries < 100, "{pid} froze inside a transaction 100 times");
        signal(pid, "CONT");
        std::thread::sleep(Duration::from_millis(20));
        signal(pid, "STOP");
    }
}

/// Whether lease `name`'s rows are free of other transactions' locks (on SQLite, the
/// database's write lock). `name` is a test's literal.
fn lease_row_free(conn: &mut tenure::AnyConnection, backend: Backend, name: &str) -> bool {
    use diesel::connection::SimpleConnection;
    if backend == Backend::Sqlite {
        return sqlite_write_lock_free(conn);
    }
    exec(conn, "BEGIN");
    let free = conn
        .batch_execute(&format!(
            "SELECT slot FROM tenure_leases WHERE name = '{name}' FOR UPDATE NOWAIT"
        ))
        .is_ok();
    exec(conn, "ROLLBACK");
    free
}

fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// The next `leading F` report with F above `after` from a candidate not in `gone` (a report
/// it sent before it was killed or stopped may still be queued): (candidate, F).
fn next_leader(
    reports: &mpsc::Receiver<(usize, String)>,
    after: i64,
    gone: &[usize],
) -> (usize, i64) {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let (who, line) = reports
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no leader above fence {after} within 120 s"));
        if let Some(fence) = line.strip_prefix("leading ").and_then(|f| f.parse().ok()) {
            if fence > after && !gone.contains(&who) {
                return (who, fence);
            }
        }
    }
}

fn leaders_killed_and_paused_never_overlap(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = match backend {
        Backend::Postgres => "id BIGSERIAL PRIMARY KEY",
        Backend::Mysql => "id BIGINT AUTO_INCREMENT PRIMARY KEY",
        Backend::Sqlite => "id INTEGER PRIMARY KEY AUTOINCREMENT",
    };
    exec(
        &mut conn,
        &format!("CREATE TABLE leader_log ({id}, fence BIGINT NOT NULL, pid BIGINT NOT NULL)"),
    );
    let (sender, reports) = mpsc::channel();
    let mut pids = Vec::new();
    for i in 0..3 {
        let mut child = spawn("candidate", &[db.url()]);
        pids.push(child.child.id());
        let sender = sender.clone();
        std::thread::spawn(move || {
            while let Some(line) = child.next_report() {
                if sender.send((i, line)).is_err() {
                    break;
                }
            }
        });
    }
    let (first, f1) = next_leader(&reports, 0, &[]);
    // Killed: another is elected.
    let killed = Instant::now();
    signal(pids[first], "KILL");
    let (second, f2) = next_leader(&reports, f1, &[first]);
    let after_kill = killed.elapsed();
    // Paused past its ttl: the third is elected; continued, the paused one writes no more.
    // A process stopped inside a transaction that verified its term (or renewed it) holds
    // the lease's row until it continues, and nobody can be elected meanwhile (that is what
    // `verify` promises): stop it again until it froze outside one.
    stop_outside_a_transaction(pids[second], &mut conn, backend, "leader");
    let paused = Instant::now();
    let (_third, f3) = next_leader(&reports, f2, &[first, second]);
    let after_pause = paused.elapsed();
    signal(pids[second], "CONT");
    std::thread::sleep(Duration::from_secs(3));
    for pid in &pids {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }

    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        fence: i64,
    }
    let rows: Vec<Row> = diesel::sql_query("SELECT fence FROM leader_log ORDER BY id")
        .load(&mut conn)
        .expect("the log");
    let fences: Vec<i64> = rows.iter().map(|r| r.fence).collect();
    assert!(
        fences.windows(2).all(|w| w[0] <= w[1]),
        "two leaders' writes interleave: {fences:?}"
    );
    for fence in [f1, f2, f3] {
        assert!(
            fences.contains(&fence),
            "term {fence} wrote nothing: {fences:?}"
        );
    }
    assert_eq!(
        count(
            &mut conn,
            "SELECT COUNT(*) AS n FROM leader_log WHERE fence > 0"
        ),
        fences.len() as i64
    );
    eprintln!(
        "{backend:?}: terms {f1}, {f2}, {f3}; a new leader {after_kill:.1?} after the kill, \
         {after_pause:.1?} after the pause (ttl {TTL:?}, lock delay one ttl)"
    );
}

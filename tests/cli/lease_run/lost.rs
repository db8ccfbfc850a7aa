//! `tenure lease run` losing its lease while the command runs: an operator's force-release
//! (the command is stopped, a waiting runner takes over, the README's fence check refuses the
//! old fence), and a runner stopped past its ttl (its watchdog ends the command; after SIGCONT
//! it exits 76).
//!
//! Timing bounds are wide (a loaded machine): each bounds a latency far above what it should
//! be, never measures it tightly.

use std::time::{Duration, Instant};

use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;
use tenure::Backend;

use crate::common::{TestDb, conformance, now_sql};
use crate::lease_run::{LONG, Runner, group_alive, lease_state, read, read_number, wait_until};

conformance!(
    lease_run_force_release_stops_the_command_and_the_next_runner_takes_over,
    lease_run_paused_runner_stops_its_command_after_sigcont,
);

/// The fence check of the README, on this backend: change `reports` only while `fence` is
/// the lease's current fence (and never back to a lower fence).
fn fence_checked_update(conn: &mut tenure::AnyConnection, backend: Backend, fence: i64) -> usize {
    let sql = format!(
        "UPDATE reports SET body = 'written by {fence}', fence = {fence} \
         WHERE id = 1 AND fence <= {fence} \
         AND EXISTS (SELECT 1 FROM tenure_leases WHERE name = 'report' AND fence = {fence} \
                     AND token IS NOT NULL AND expires_at > {})",
        now_sql(backend)
    );
    diesel::sql_query(sql)
        .execute(conn)
        .expect("fence-checked update")
}

/// An operator force-releases the lease while the command runs: the command gets SIGTERM
/// within the ttl (it traps it and keeps going), is killed after the grace period, the runner
/// exits 76 saying why, and a waiting runner takes over with a higher fence. The README's
/// fence check then refuses the old fence and accepts the new one.
fn lease_run_force_release_stops_the_command_and_the_next_runner_takes_over(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut conn = db.connect();
    conn.batch_execute(
        "CREATE TABLE reports (id INTEGER PRIMARY KEY, body VARCHAR(100), fence BIGINT NOT NULL)",
    )
    .unwrap();
    conn.batch_execute("INSERT INTO reports (id, body, fence) VALUES (1, 'none', 0)")
        .unwrap();

    let ttl = Duration::from_secs(6);
    let mut first = Runner::start(
        url,
        d,
        "first",
        &[
            "report",
            "--ttl",
            "6s",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; trap 'echo term >> \"$DIR/a.log\"' TERM; \
           echo $$ > \"$DIR/a.pid\"; while :; do sleep 0.1; done",
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let a_fence = read_number(&d.join("a.fence"));
    assert_eq!(fence_checked_update(&mut conn, backend, a_fence), 1);
    let mut second = Runner::start(
        url,
        d,
        "second",
        &[
            "report",
            "--ttl",
            "6s",
            "--wait",
            "120s",
            "-v",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/b.fence\"; while [ ! -e \"$DIR/b.stop\" ]; do sleep 0.05; done",
        ],
    );
    wait_until(LONG, "the second runner waits", || {
        second.stderr().contains("waiting")
    });

    let released_at = Instant::now();
    crate::ok(url, &["leases", "release", "report", "--force"]);
    wait_until(LONG, "the command gets SIGTERM", || {
        read(&d.join("a.log")).contains("term")
    });
    let term_after = released_at.elapsed();
    let status = first.exit(LONG);
    let gone_after = released_at.elapsed();
    eprintln!(
        "{backend:?}: force-release -> SIGTERM {term_after:.2?}, runner exited {gone_after:.2?}"
    );
    assert!(
        term_after < ttl,
        "SIGTERM took {term_after:?}, longer than the ttl"
    );
    assert_eq!(status.code(), Some(76), "{}", first.stderr());
    let message = first.stderr();
    assert!(
        message.contains("lost the lease") && message.contains("force-released"),
        "{message}"
    );
    assert!(
        message.contains("SIGKILL"),
        "it ignored SIGTERM, so SIGKILL: {message}"
    );
    assert!(
        !group_alive(pgid),
        "the command's group outlived its runner"
    );

    let b_fence = read_number(&d.join("b.fence"));
    assert!(b_fence > a_fence, "{b_fence} > {a_fence}");
    assert_eq!(lease_state(url, "report"), (true, b_fence));
    // The old fence changes nothing; the current one does.
    assert_eq!(fence_checked_update(&mut conn, backend, a_fence), 0);
    assert_eq!(fence_checked_update(&mut conn, backend, b_fence), 1);

    std::fs::write(d.join("b.stop"), "").unwrap();
    assert_eq!(second.exit(LONG).code(), Some(0), "{}", second.stderr());
    assert_eq!(lease_state(url, "report"), (false, b_fence));
    // After the release even the last fence is refused.
    assert_eq!(fence_checked_update(&mut conn, backend, b_fence), 0);
}

/// A runner stopped (SIGSTOP) past its ttl loses the lease to a second runner. Its watchdog,
/// not stopped with it, ends the command at the lease's deadline; after SIGCONT the runner
/// finds the lease lost and exits 76, while the new holder keeps the lease.
fn lease_run_paused_runner_stops_its_command_after_sigcont(backend: Backend) {
    let db = TestDb::migrated(backend);
    let url = db.url();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut paused = Runner::start(
        url,
        d,
        "paused",
        &[
            "sleepy",
            "--ttl",
            "3s",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/a.fence\"; echo $$ > \"$DIR/a.pid\"; \
           while :; do sleep 0.1; done",
        ],
    );
    let pgid = read_number(&d.join("a.pid"));
    let a_fence = read_number(&d.join("a.fence"));
    paused.signal("STOP");
    let mut next = Runner::start(
        url,
        d,
        "next",
        &[
            "sleepy",
            "--ttl",
            "3s",
            "--wait",
            "120s",
            "--",
            "sh",
            "-c",
            "echo $TENURE_LEASE_FENCE > \"$DIR/b.fence\"; while [ ! -e \"$DIR/b.stop\" ]; do sleep 0.05; done",
        ],
    );
    let b_fence = read_number(&d.join("b.fence"));
    assert!(b_fence > a_fence);
    // Only the runner was stopped; the command (SIGTERM not trapped) is gone all the same.
    wait_until(LONG, "the watchdog ends the command", || !group_alive(pgid));
    let resumed = Instant::now();
    paused.signal("CONT");
    let status = paused.exit(LONG);
    eprintln!(
        "{backend:?}: SIGCONT -> paused runner exited {:.2?}",
        resumed.elapsed()
    );
    assert_eq!(status.code(), Some(76), "{}", paused.stderr());
    let message = paused.stderr();
    assert!(message.contains("did not run for"), "{message}");
    assert!(!group_alive(pgid), "the paused runner's command still runs");
    // Its exit did not disturb the new holder.
    assert_eq!(lease_state(url, "sleepy"), (true, b_fence));
    std::fs::write(d.join("b.stop"), "").unwrap();
    assert_eq!(next.exit(LONG).code(), Some(0), "{}", next.stderr());
    assert_eq!(lease_state(url, "sleepy"), (false, b_fence));
}

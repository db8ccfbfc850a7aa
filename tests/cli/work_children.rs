//! `tenure work`'s commands as processes: a command inherits no descriptor of the worker (its
//! database connections), its whole process group ends when the worker dies (even by
//! SIGKILL) before the job can run again beside it, and a timeout or a cancel ends the group
//! also when a child the command put in the background holds its output open.
//!
//! Found by the edges review (issue 32, items 2, 3 and 6): a SIGKILLed worker's command ran on
//! beside the rescued run; on MariaDB a command inherited the worker's lock connection and kept
//! the dead worker "alive"; `sleep 20 & echo started` outlived its timeout and its cancel.

use std::process::{Command, Stdio};
use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, JobState};

use super::common::{TestDb, conformance, job_state, wait_until};
use super::{Worker, json};

conformance!(
    a_command_inherits_no_descriptor_of_the_worker,
    a_killed_workers_command_ends_before_its_job_runs_again,
    a_timeout_ends_a_command_whose_background_child_holds_the_output,
    a_cancel_ends_a_command_whose_background_child_holds_the_output,
);

/// Whether process `pid` exists and is not a zombie (a container's init may never reap one).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_string();
            Some(state != "Z")
        })
        .unwrap_or(false)
}

fn start_worker(url: &str, queue: &str, extra: &[&str]) -> Worker {
    Worker(
        Command::new(env!("CARGO_BIN_EXE_tenure"))
            .args(["--database-url", url, "work", "--queue", queue])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tenure work"),
    )
}

fn enqueue(url: &str, queue: &str, command: &str, extra: &[&str]) -> i64 {
    let mut args = vec!["enqueue", "--queue", queue, "--command", command];
    args.extend_from_slice(extra);
    json(url, &args)["id"].as_i64().expect("the job's id")
}

fn read(path: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|text| !text.trim().is_empty())
}

fn a_command_inherits_no_descriptor_of_the_worker(backend: Backend) {
    let db = TestDb::migrated(backend);
    let dir = tempfile::tempdir().unwrap();
    let listing = dir.path().join("fds");
    // The shell's own descriptors, by what they point at.
    let command = format!(
        "for fd in /proc/$$/fd/*; do echo \"${{fd##*/}} $(readlink \"$fd\")\"; done > '{}.tmp'; mv '{0}.tmp' '{0}'",
        listing.display()
    );
    enqueue(db.url(), "fds", &command, &[]);
    let _worker = start_worker(db.url(), "fds", &[]);
    let fds = wait_until(
        "the command's descriptor listing",
        Duration::from_secs(60),
        || read(&listing),
    );
    for line in fds.lines() {
        let (fd, target) = line.split_once(' ').unwrap_or((line, ""));
        let fd: u32 = fd.parse().unwrap_or(u32::MAX);
        // 0-2 are its streams; 255 is the descriptor dash keeps for the script, if any.
        if fd <= 2 {
            continue;
        }
        assert!(
            !target.starts_with("socket:")
                && !target.contains("jobs.db")
                && !target.contains("tenure"),
            "the command inherited descriptor {fd} -> {target}:\n{fds}"
        );
    }
}

fn a_killed_workers_command_ends_before_its_job_runs_again(backend: Backend) {
    let db = TestDb::migrated(backend);
    let dir = tempfile::tempdir().unwrap();
    let (bgpid, log) = (dir.path().join("bgpid"), dir.path().join("log"));
    // Each run first looks for the previous run's background child, then leaves one of its
    // own and waits.
    let command = format!(
        "if [ -f '{bg}' ] && [ -r /proc/$(cat '{bg}')/stat ] && ! grep -q ') Z' /proc/$(cat '{bg}')/stat; \
         then echo overlap >> '{log}'; fi; sleep 300 & echo $! > '{bg}'; echo started >> '{log}'; wait",
        bg = bgpid.display(),
        log = log.display()
    );
    let id = enqueue(db.url(), "crash", &command, &["--max-attempts", "5"]);
    let mut first = start_worker(db.url(), "crash", &[]);
    wait_until("the first run", Duration::from_secs(60), || {
        read(&log).filter(|l| l.contains("started"))
    });
    let first_child = std::fs::read_to_string(&bgpid).unwrap();
    assert!(alive(&first_child));
    // A second worker, idle, ready to take the job back once the first is found dead.
    let second = start_worker(db.url(), "crash", &[]);
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    wait_until(
        "the first run's command to end with its worker",
        Duration::from_secs(10),
        || (!alive(&first_child)).then_some(()),
    );
    let log_text = wait_until("the rescued run", Duration::from_secs(120), || {
        read(&log).filter(|l| l.matches("started").count() >= 2)
    });
    assert!(
        !log_text.contains("overlap"),
        "the rescued run ran beside the first: {log_text}"
    );
    let second_child = std::fs::read_to_string(&bgpid).unwrap();
    drop(second);
    wait_until(
        "the second run's command to end with its worker",
        Duration::from_secs(10),
        || (!alive(&second_child)).then_some(()),
    );
    let mut conn = db.connect();
    // The first run's claim was rescued (a lapse, no attempt used); the second is running.
    let job = jobs::get(&mut conn, id).unwrap().unwrap();
    assert_eq!((job.attempt, job.lapses), (1, 1), "{job:?}");
}

fn background_child_holding_the_output(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    let bgpid = dir.join("bgpid");
    // The shell exits at once; its child keeps the output pipe open for 300 s.
    let command = format!("sleep 300 & echo $! > '{}'; echo started", bgpid.display());
    (command, bgpid)
}

fn a_timeout_ends_a_command_whose_background_child_holds_the_output(backend: Backend) {
    let db = TestDb::migrated(backend);
    let dir = tempfile::tempdir().unwrap();
    let (command, bgpid) = background_child_holding_the_output(dir.path());
    let id = enqueue(db.url(), "slow", &command, &["--max-attempts", "1"]);
    let _worker = start_worker(db.url(), "slow", &["--timeout", "2s"]);
    let child = wait_until("the command's start", Duration::from_secs(60), || {
        read(&bgpid)
    });
    let mut conn = db.connect();
    wait_until("the timed-out run's end", Duration::from_secs(60), || {
        (job_state(&mut conn, id) == JobState::Dead).then_some(())
    });
    wait_until(
        "the background child's end",
        Duration::from_secs(10),
        || (!alive(&child)).then_some(()),
    );
}

fn a_cancel_ends_a_command_whose_background_child_holds_the_output(backend: Backend) {
    let db = TestDb::migrated(backend);
    let dir = tempfile::tempdir().unwrap();
    let (command, bgpid) = background_child_holding_the_output(dir.path());
    let id = enqueue(db.url(), "cancel", &command, &[]);
    let _worker = start_worker(db.url(), "cancel", &["--timeout", "1h"]);
    let child = wait_until("the command's start", Duration::from_secs(60), || {
        read(&bgpid)
    });
    let mut conn = db.connect();
    assert!(jobs::cancel(&mut conn, id).unwrap());
    wait_until("the cancelled run's end", Duration::from_secs(60), || {
        (job_state(&mut conn, id) == JobState::Cancelled).then_some(())
    });
    wait_until(
        "the background child's end",
        Duration::from_secs(10),
        || (!alive(&child)).then_some(()),
    );
}

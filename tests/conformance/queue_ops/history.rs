//! A job's error history: kept per failed or lapsed run, bounded, and a dead job's last failed
//! run stamped when it finished.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, JobState, NewJob, Retry};

use super::TTL;
use crate::common::{TestDb, conformance};

conformance!(
    error_history_is_kept_and_bounded,
    a_dead_jobs_last_failed_run_is_when_it_finished,
);

fn error_history_is_kept_and_bounded(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let id = jobs::enqueue(&mut conn, &NewJob::new("h", "k", vec![]).max_attempts(30))
        .unwrap()
        .id;
    for attempt in 1..=25 {
        let job = jobs::claim(&mut conn, "h", 1, TTL).unwrap().remove(0);
        let error = if attempt == 25 {
            "ü".repeat(3000)
        } else {
            format!("failure {attempt}")
        };
        jobs::fail(&mut conn, job.claim(), &error, Retry::After(Duration::ZERO)).unwrap();
    }
    // A stalled run leaves its error too.
    let job = jobs::claim(&mut conn, "h", 1, Duration::from_millis(50))
        .unwrap()
        .remove(0);
    assert_eq!(job.attempt, 26);
    std::thread::sleep(Duration::from_millis(150));
    jobs::rescue(&mut conn, 10).unwrap();
    let history = jobs::history(&mut conn, id).unwrap();
    assert_eq!(history.len(), jobs::MAX_ERROR_HISTORY);
    assert_eq!(history.first().unwrap().attempt, 7);
    assert_eq!(history[0].error, "failure 7");
    assert!(history[18].error.len() <= jobs::MAX_ERROR_BYTES && history[18].error.starts_with('ü'));
    assert_eq!(history.last().unwrap().attempt, 26);
    assert!(history.last().unwrap().error.contains("lapsed"));
}

/// A dead job's page showed "finished .224" but "run 3 failed at .225": the history's instant
/// was read by the next statement. Found by the first-hour review (issue 31, item 9).
fn a_dead_jobs_last_failed_run_is_when_it_finished(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for round in 0..20 {
        let id = jobs::enqueue(&mut conn, &NewJob::new("d", "k", vec![]).max_attempts(2))
            .unwrap()
            .id;
        let first = jobs::claim(&mut conn, "d", 1, TTL).unwrap().remove(0);
        jobs::fail(
            &mut conn,
            first.claim(),
            "once",
            Retry::After(Duration::ZERO),
        )
        .unwrap();
        let second = jobs::claim(&mut conn, "d", 1, TTL).unwrap().remove(0);
        let retry_ended = if round % 2 == 0 {
            Retry::Never
        } else {
            Retry::After(Duration::ZERO)
        };
        jobs::fail(&mut conn, second.claim(), "for good", retry_ended).unwrap();
        let job = jobs::get(&mut conn, id).unwrap().unwrap();
        assert_eq!(job.state, JobState::Dead);
        let history = jobs::history(&mut conn, id).unwrap();
        assert_eq!(history.len(), 2);
        assert_eq!(
            Some(history[1].failed_at),
            job.finished_at,
            "round {round}: {history:?}"
        );
        assert!(history[0].failed_at <= history[1].failed_at);
    }
}

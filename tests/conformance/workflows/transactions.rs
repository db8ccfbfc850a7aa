//! Workflows inside callers' transactions: a completion at REPEATABLE READ never misses a
//! dependent, and a result rolled back with the caller's transaction leaves nothing.

use diesel::Connection;
use diesel::connection::SimpleConnection;
use tenure::jobs::{self, JobResult, JobState, NewJob, Outcome};
use tenure::{Backend, Error};

use crate::common::{
    TestDb, claim_one, conformance, count, enqueue_id as enqueue, job_state as state,
};

conformance!(
    a_completion_in_a_repeatable_read_transaction_never_misses_a_dependent,
    a_completion_with_a_result_rolled_back_with_the_callers_transaction_leaves_nothing,
);

/// A handler's own transaction at REPEATABLE READ (MySQL's default isolation; a choice on
/// PostgreSQL) reads first, then completes its job. Meanwhile a second dependent of the job
/// was enqueued (the job already had one, so its row is not written again). Either the
/// completion fails (a serialization error, nothing changed) or it releases both
/// dependents: it must never commit the completion and leave the second one blocked.
fn a_completion_in_a_repeatable_read_transaction_never_misses_a_dependent(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let mut handler = db.connect();
    match backend {
        Backend::Postgres => handler.batch_execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        ),
        Backend::Mysql => {
            handler.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        }
        Backend::Sqlite => Ok(()),
    }
    .unwrap();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let first = enqueue(&mut conn, NewJob::new("d", "first", vec![]).depends_on([a]));
    let job_a = claim_one(&mut conn, "q", "a");
    let mut second = 0;
    let outcome = handler.transaction::<_, Error, _>(|h| {
        // The handler reads (its snapshot starts here) ...
        assert_eq!(jobs::get(h, a)?.unwrap().state, JobState::Running);
        // ... another process adds a dependent of the job and commits ...
        second = enqueue(
            &mut conn,
            NewJob::new("d", "second", vec![]).depends_on([a]),
        );
        // ... and the handler completes its job.
        jobs::complete(h, &[job_a.claim()])
    });
    match outcome {
        Ok(outcomes) => {
            assert_eq!(outcomes, vec![Outcome::Done]);
            assert_eq!(state(&mut conn, a), JobState::Completed);
            assert_eq!(
                state(&mut conn, first),
                JobState::Waiting,
                "first dependent"
            );
            let edge = count(
                &mut conn,
                &format!(
                    "SELECT COUNT(*) AS n FROM tenure_job_dependencies \
                     WHERE job_id = {second} AND counted = 1"
                ),
            );
            assert_eq!(
                state(&mut conn, second),
                JobState::Waiting,
                "the completion committed, but the dependent enqueued after the handler's \
                 snapshot was left blocked forever (its edge counted: {edge})"
            );
        }
        Err(e) => {
            assert!(e.is_retryable(), "not a serialization error: {e}");
            assert_eq!(state(&mut conn, a), JobState::Running);
            assert_eq!(state(&mut conn, second), JobState::Blocked);
        }
    }
}

/// A completion with a result inside the caller's transaction that rolls back: the job is
/// still running, no result, its dependent blocked; completing again (another result)
/// releases the dependent, which reads the second result.
fn a_completion_with_a_result_rolled_back_with_the_callers_transaction_leaves_nothing(
    backend: Backend,
) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let a = enqueue(&mut conn, NewJob::new("q", "a", vec![]));
    let d = enqueue(&mut conn, NewJob::new("q", "d", vec![]).depends_on([a]));
    let job_a = claim_one(&mut conn, "q", "a");
    let rolled: Result<(), Error> = tenure::transaction(&mut conn, |c| {
        let first = JobResult::bytes(vec![0xff, 0xfe, 0]).unwrap();
        assert_eq!(
            jobs::complete_with_result(c, job_a.claim(), &first)?,
            Outcome::Done
        );
        Err(Error::Database(diesel::result::Error::RollbackTransaction))
    });
    assert!(rolled.is_err());
    assert_eq!(state(&mut conn, a), JobState::Running);
    assert_eq!(state(&mut conn, d), JobState::Blocked);
    assert_eq!(jobs::result(&mut conn, a).unwrap(), None);
    let second = JobResult::json(&"second").unwrap();
    assert_eq!(
        jobs::complete_with_result(&mut conn, job_a.claim(), &second).unwrap(),
        Outcome::Done
    );
    assert_eq!(state(&mut conn, d), JobState::Waiting);
    let read = jobs::dependency_results(&mut conn, d).unwrap();
    assert_eq!(read[0].result.as_ref(), Some(&second));
}

/// A Galera node may roll a transaction back between two statements without telling the next
/// one, which then runs in autocommit (SCALING.md, 0.1). Here the same on one server: the
/// caller's transaction is ended by a bare `COMMIT` that diesel does not know of, and a
/// completion runs in it. The completion must change nothing (its writes hold only inside a
/// transaction) and say the call can be repeated; repeated in a real transaction, it counts the
/// dependency and releases the dependent. Without the guard the completion committed on its
/// own, statement by statement.
#[cfg(feature = "mysql")]
#[test]
fn mysql_a_completion_whose_transaction_ended_under_it_changes_nothing() {
    let db = TestDb::migrated(Backend::Mysql);
    let mut conn = db.connect();
    let dep = enqueue(&mut conn, NewJob::new("q", "dep", vec![]));
    let dependent = jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "after", vec![]).depends_on([dep]),
    )
    .unwrap()
    .id;
    let claim = claim_one(&mut conn, "q", "dep").claim();
    let split = tenure::transaction(&mut conn, |conn| {
        conn.batch_execute("COMMIT")?;
        jobs::complete(conn, &[claim])
    });
    match split {
        Err(e @ Error::RolledBackUnderUs { .. }) => assert!(e.is_retryable()),
        other => panic!("a completion outside its transaction: {other:?}"),
    }
    assert_eq!(state(&mut conn, dep), JobState::Running);
    assert_eq!(state(&mut conn, dependent), JobState::Blocked);
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT COUNT(*) AS n FROM tenure_job_dependencies WHERE counted = 1 AND depends_on = {dep}"
            )
        ),
        0
    );
    assert_eq!(
        jobs::complete(&mut conn, &[claim]).unwrap(),
        [Outcome::Done]
    );
    assert_eq!(state(&mut conn, dependent), JobState::Waiting);
}

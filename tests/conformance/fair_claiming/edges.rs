//! What the virtual time a late tenant joins at must not be moved by: a backlogged tenant's
//! urgent job (another priority), a job not yet due.

use std::time::Duration;

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::common::{TestDb, conformance, enqueue_id};

conformance!(
    an_urgent_job_of_a_backlogged_tenant_does_not_push_others_behind_its_backlog,
    a_job_not_yet_due_does_not_let_a_late_tenant_jump_the_turns,
);

const TTL: Duration = Duration::from_secs(600);

fn an_urgent_job_of_a_backlogged_tenant_does_not_push_others_behind_its_backlog(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let backlog: Vec<NewJob> = (0..200)
        .map(|_| NewJob::new("u", "a", vec![]).fair_key("a"))
        .collect();
    jobs::enqueue_many(&mut conn, &backlog).unwrap();
    // A's urgent job takes A's next turn (after its 200) and runs at once.
    let urgent = enqueue_id(
        &mut conn,
        NewJob::new("u", "a", vec![]).fair_key("a").priority(-1),
    );
    let running = jobs::claim(&mut conn, "u", 1, TTL).unwrap();
    assert_eq!(running[0].id, urgent);
    let b = enqueue_id(&mut conn, NewJob::new("u", "b", vec![]).fair_key("b"));
    let next = jobs::claim(&mut conn, "u", 3, TTL).unwrap();
    assert!(
        next.iter().any(|job| job.id == b),
        "b waits behind a's backlog because a's urgent job runs"
    );
}

fn a_job_not_yet_due_does_not_let_a_late_tenant_jump_the_turns(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    // X's job, due in an hour, has the first turn of all.
    enqueue_id(
        &mut conn,
        NewJob::new("d", "x", vec![])
            .fair_key("x")
            .delay(Duration::from_secs(3600)),
    );
    let backlog: Vec<NewJob> = (0..100)
        .map(|_| NewJob::new("d", "a", vec![]).fair_key("a"))
        .collect();
    jobs::enqueue_many(&mut conn, &backlog).unwrap();
    let done = jobs::claim(&mut conn, "d", 50, TTL).unwrap();
    let claims: Vec<_> = done.iter().map(|job| job.claim()).collect();
    jobs::complete(&mut conn, &claims).unwrap();
    // B arrives with 20 jobs: they take turns with a's next 20, not all before them.
    let late: Vec<NewJob> = (0..20)
        .map(|_| NewJob::new("d", "b", vec![]).fair_key("b"))
        .collect();
    jobs::enqueue_many(&mut conn, &late).unwrap();
    let next = jobs::claim(&mut conn, "d", 20, TTL).unwrap();
    let of_a = next.iter().filter(|job| job.kind == "a").count();
    assert!(
        (8..=12).contains(&of_a),
        "a got {of_a} of the 20 claims after b arrived"
    );
}

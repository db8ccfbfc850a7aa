//! `jobs::queue_depth`: bounded counts of a queue's waiting, due and running jobs.

use std::time::Duration;

use chrono::{TimeDelta, Utc};
use tenure::jobs::{self, NewJob, QueueDepth};
use tenure::{Backend, Error};

use crate::common::{TestDb, conformance};

conformance!(
    depth_counts_waiting_due_and_running_of_one_queue,
    depth_stops_at_its_bound,
    depth_refuses_bad_input,
    depth_agrees_with_the_table,
);

fn depth(waiting: u64, due: u64, running: u64) -> QueueDepth {
    QueueDepth {
        waiting,
        due,
        running,
    }
}

fn depth_counts_waiting_due_and_running_of_one_queue(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 100).unwrap(),
        depth(0, 0, 0)
    );
    let batch: Vec<NewJob> = (0..10)
        .map(|i| {
            let job = NewJob::new("q", "k", vec![]);
            if i < 3 {
                job.delay(Duration::from_secs(3600))
            } else {
                job
            }
        })
        .collect();
    let ids = jobs::enqueue_many(&mut conn, &batch).unwrap();
    // Another queue's jobs and a blocked job are not counted.
    jobs::enqueue(&mut conn, &NewJob::new("other", "k", vec![])).unwrap();
    jobs::enqueue(
        &mut conn,
        &NewJob::new("q", "k", vec![]).depends_on([ids[0].id]),
    )
    .unwrap();
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 100).unwrap(),
        depth(10, 7, 0)
    );
    let claimed = jobs::claim(&mut conn, "q", 4, Duration::from_secs(60)).unwrap();
    assert_eq!(claimed.len(), 4);
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 100).unwrap(),
        depth(6, 3, 4)
    );
    jobs::complete(&mut conn, &[claimed[0].claim(), claimed[1].claim()]).unwrap();
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 100).unwrap(),
        depth(6, 3, 2)
    );
    assert_eq!(
        jobs::queue_depth(&mut conn, "other", 100).unwrap(),
        depth(1, 1, 0)
    );
}

fn depth_stops_at_its_bound(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..500).map(|_| NewJob::new("q", "k", vec![])).collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    jobs::claim(&mut conn, "q", 200, Duration::from_secs(60)).unwrap();
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 50).unwrap(),
        depth(50, 50, 50)
    );
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 300).unwrap(),
        depth(300, 300, 200)
    );
    assert_eq!(
        jobs::queue_depth(&mut conn, "q", 1).unwrap(),
        depth(1, 1, 1)
    );
}

fn depth_refuses_bad_input(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    for (queue, bound) in [
        ("q", 0),
        ("q", jobs::MAX_DEPTH_BOUND + 1),
        ("", 10),
        ("a\0b", 10),
    ] {
        match jobs::queue_depth(&mut conn, queue, bound) {
            Err(Error::InvalidInput { .. }) => {}
            other => panic!("{queue:?}, {bound}: {other:?}"),
        }
    }
}

fn depth_agrees_with_the_table(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let batch: Vec<NewJob> = (0..120)
        .map(|i| {
            let job = NewJob::new(if i % 10 == 0 { "Q" } else { "q" }, "k", vec![]);
            match i % 3 {
                0 => job.delay(Duration::from_secs(3600)),
                1 => job.at(Utc::now() - TimeDelta::days(365 * 50)),
                _ => job,
            }
        })
        .collect();
    jobs::enqueue_many(&mut conn, &batch).unwrap();
    jobs::claim(&mut conn, "q", 7, Duration::from_secs(60)).unwrap();
    let expect = |queue: &str, bound: u64| {
        let of = |pred: &dyn Fn(usize) -> bool| {
            (0..120)
                .filter(|i| (i % 10 == 0) == (queue == "Q") && pred(*i))
                .count() as u64
        };
        let waiting = of(&|_| true);
        let due = of(&|i| i % 3 != 0);
        let claimed = if queue == "q" { 7 } else { 0 };
        QueueDepth {
            waiting: (waiting - claimed).min(bound),
            due: (due - claimed).min(bound),
            running: claimed.min(bound),
        }
    };
    for queue in ["q", "Q"] {
        for bound in [1u32, 5, 70, 1000, jobs::MAX_DEPTH_BOUND] {
            assert_eq!(
                jobs::queue_depth(&mut conn, queue, bound).unwrap(),
                expect(queue, u64::from(bound)),
                "{queue} bound {bound}"
            );
        }
    }
    // Names that differ only in case, trailing space or a prefix are other queues.
    for other in ["q ", "qq", "Q ", " q"] {
        assert_eq!(
            jobs::queue_depth(&mut conn, other, 100).unwrap(),
            QueueDepth::default(),
            "{other:?}"
        );
    }
}

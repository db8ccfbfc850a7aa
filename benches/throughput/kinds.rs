//! K and L: claims of one kind (K) or two (L) behind 100,000 due jobs of another kind ahead
//! of them by priority.

use std::time::{Duration, Instant};

use tenure::Backend;
use tenure::jobs::{self, NewJob};

use crate::drain::settle;
use crate::options::Options;
use crate::support::{BenchDb, Figures, with_latencies};

/// K / L. Claims of `kinds` (N jobs, spread over them) behind 100,000 due jobs of kind B
/// ahead of them by priority, on one connection, 10 per claim, each batch completed.
pub fn kinds_backlog(backend: Backend, options: &Options, kinds: &[&str]) -> Figures {
    const BACKLOG: usize = 100_000;
    let db = BenchDb::new(backend);
    let mut conn = db.connect();
    let mut left = BACKLOG;
    while left > 0 {
        let now = left.min(10_000);
        let backlog: Vec<NewJob> = (0..now)
            .map(|_| NewJob::new("bench", "B", vec![b'x'; options.payload]).priority(-1))
            .collect();
        jobs::enqueue_many(&mut conn, &backlog).expect("fill the backlog");
        left -= now;
    }
    let wanted: Vec<NewJob> = (0..options.jobs)
        .map(|i| NewJob::new("bench", kinds[i % kinds.len()], vec![b'x'; options.payload]))
        .collect();
    for chunk in wanted.chunks(10_000) {
        jobs::enqueue_many(&mut conn, chunk).expect("fill");
    }
    settle(backend, &mut conn);
    let ttl = Duration::from_secs(60);
    let mut latencies = Vec::new();
    let (mut done, started) = (0, Instant::now());
    while done < options.jobs {
        let t = Instant::now();
        let claimed = jobs::claim_kinds(&mut conn, "bench", kinds, 10, ttl).expect("claim");
        latencies.push(t.elapsed());
        assert!(!claimed.is_empty(), "the claimed kinds ran out early");
        assert!(claimed.iter().all(|j| j.kind != "B"), "a B job was claimed");
        let claims: Vec<_> = claimed.iter().map(|j| j.claim()).collect();
        jobs::complete(&mut conn, &claims).expect("complete");
        done += claimed.len();
    }
    with_latencies(done as f64 / started.elapsed().as_secs_f64(), latencies)
}

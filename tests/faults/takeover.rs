//! Fast takeover across processes: a lease holder's process SIGKILLed loses its lease within
//! seconds (by its liveness lock), not at the end of its ttl; one SIGSTOPped keeps it until
//! its ttl, as a slow holder must (its lock is still held).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use tenure::lease::{Take, Wait};
use tenure::{Backend, LeaseGuard, Pool};

use crate::child::{Spawned, report, spawn};
use crate::common::{TestDb, concrete, conformance, placeholders};
use crate::leaders::stop_outside_a_transaction;

conformance!(
    a_killed_holders_lease_is_taken_over_within_seconds,
    a_stopped_holder_keeps_its_lease_until_its_ttl,
);

/// The child: takes lease `name` for `ttl_secs` through a guard from a pool (so it holds a
/// liveness lock), reports `held F`, and keeps it until killed.
pub fn pooled_holder(url: &str, name: &str, ttl_secs: &str) {
    pooled_holder_of(url, name, ttl_secs, "1");
}

/// The child: [`pooled_holder`] for a lease of `holders` holders.
pub fn pooled_holder_of(url: &str, name: &str, ttl_secs: &str, holders: &str) {
    let pool = Pool::options().max_size(2).open(url).expect("pool");
    let ttl = Duration::from_secs(ttl_secs.parse().expect("ttl"));
    let take = Take::new(name, ttl, "child")
        .holders(holders.parse().expect("holders"))
        .wait(Wait::up_to(Duration::from_secs(60)));
    let guard = LeaseGuard::take_pooled_as(&pool, &take)
        .expect("take")
        .expect("the lease was free");
    report(format!("held {}", guard.fence()));
    let until = Instant::now() + Duration::from_secs(600);
    while Instant::now() < until && !guard.wait_lost(Duration::from_secs(1)) {}
    report("lost");
    std::thread::sleep(Duration::from_secs(600));
}

pub(crate) fn held_fence(child: &mut Spawned) -> i64 {
    let line = child.next_report().expect("the holder's report");
    line.strip_prefix("held ")
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("expected `held F`, got {line:?}"))
}

/// SIGKILLed with a ttl of ten minutes: another process's waiting take gets the lease within
/// 90 s (expected: at once on SQLite, about 8 s on the servers), with a greater fence.
fn a_killed_holders_lease_is_taken_over_within_seconds(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    for round in 0..2 {
        let name = format!("killed-{round}");
        let mut holder = spawn("pooled-holder", &[db.url(), &name, "600"]);
        let fence = held_fence(&mut holder);
        holder.signal("KILL");
        let _ = holder.child.wait();
        let killed = Instant::now();
        let wait = Wait::up_to(Duration::from_secs(90));
        let taker = LeaseGuard::take_pooled_as(
            &pool,
            &Take::new(&name, Duration::from_secs(600), "taker").wait(wait),
        )
        .unwrap()
        .expect("taken over within 90 s of the kill, not at the end of the 600 s ttl");
        assert!(taker.fence() > fence);
        eprintln!(
            "{backend:?}: a SIGKILLed holder's lease taken over {:.1?} after the kill",
            killed.elapsed()
        );
    }
}

#[derive(QueryableByName)]
struct Slot {
    #[diesel(sql_type = tenure::sql_types::Instant)]
    expires_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<BigInt>)]
    held_by: Option<i64>,
}

/// SIGSTOPped (outside any transaction on the lease's row, which would hold every taker
/// until it continued, as `verify` promises): its process lives, so its liveness lock stays
/// held, and the lease is granted again only once its ttl ran out, by the database's clock.
fn a_stopped_holder_keeps_its_lease_until_its_ttl(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(2);
    let mut conn = db.connect();
    let name = "stopped";
    let mut holder = spawn("pooled-holder", &[db.url(), name, "4"]);
    let fence = held_fence(&mut holder);
    stop_outside_a_transaction(holder.child.id(), &mut conn, backend, name);
    // Read once frozen: a renewal committed later would only move the expiry later.
    let sql = format!(
        "SELECT expires_at, held_by FROM tenure_leases WHERE name = {} AND slot = 0",
        placeholders(backend, 1)
    );
    let before: Slot =
        concrete!(&mut conn, c => diesel::sql_query(&sql).bind::<Text, _>(name).get_result(c))
            .expect("the holder's slot");
    assert!(
        before.held_by.is_some_and(|key| key > 0),
        "the guard recorded its liveness lock"
    );
    let wait = Wait::up_to(Duration::from_secs(90));
    let taker = LeaseGuard::take_pooled_as(
        &pool,
        &Take::new(name, Duration::from_secs(60), "taker").wait(wait),
    )
    .unwrap()
    .expect("granted once the stopped holder's ttl ran out");
    assert!(taker.fence() > fence);
    assert!(
        taker.lease().acquired_at() >= before.expires_at,
        "granted at {} before the stopped holder's expiry {}",
        taker.lease().acquired_at(),
        before.expires_at
    );
    holder.signal("CONT");
}

//! The guard: `LeaseGuard` renews its lease while it lives, reports the loss at its deadline
//! when renewals hang, and stops renewing when evicted.

use std::time::{Duration, Instant as Clock};

use diesel::prelude::*;
use diesel::sql_types::Text;
use tenure::lease::{self, Wait};
use tenure::{Backend, Error, LeaseGuard};

use super::{LONG, raw_lease};
use crate::common::{TestDb, conformance, placeholders};

conformance!(
    guard_keeps_the_lease_across_several_ttls,
    guard_reports_loss_at_its_deadline_when_renewals_hang,
    guard_stops_renewing_when_evicted,
);

/// A guard renews its own lease every ttl/3 and nothing after it is dropped. Its renewals
/// are counted in its own row (each moves `expires_at` on), not as renewal threads of the
/// process: other tests' guards run in the same process under `cargo test`, and a
/// bystander guard held throughout this test stands for them (counting threads named
/// `tenure-lease-*` saw 2 here, and failed under `cargo test`; item 13).
fn guard_keeps_the_lease_across_several_ttls(backend: Backend) {
    let db = TestDb::migrated(backend);
    // Long enough that a renewal thread starved by a busy machine (load 10) still renews
    // before the guard's local deadline (ttl - ttl/10 after the last renewal's send): at
    // 300 ms, a 270 ms stall under load made the guard give the lease up.
    let ttl = Duration::from_millis(1500);
    let bystander = LeaseGuard::try_take(db.pool(1).get().unwrap(), "bystander", LONG, "other")
        .unwrap()
        .expect("free");
    let guard = LeaseGuard::try_take(db.pool(1).get().unwrap(), "guarded", ttl, "guard")
        .unwrap()
        .expect("free");
    let mut rival = db.connect();
    let until = Clock::now() + ttl * 4;
    // held_until: within a ttl from now, only ever later (`tenure lease run`'s watchdog
    // stops its command by it).
    let mut held_until = guard.held_until().expect("held");
    assert!(held_until <= Clock::now() + ttl);
    let (mut attempts, mut renewals, mut moved) = (0, 0, 0);
    let mut last = raw_lease(&mut rival, "guarded");
    while Clock::now() < until {
        assert!(
            lease::try_take(&mut rival, "guarded", ttl, "rival")
                .unwrap()
                .is_none()
        );
        assert!(guard.is_held());
        let now_held_until = guard.held_until().expect("held");
        assert!(now_held_until >= held_until && now_held_until <= Clock::now() + ttl);
        moved += usize::from(now_held_until > held_until);
        held_until = now_held_until;
        let row = raw_lease(&mut rival, "guarded");
        assert_eq!(
            (row.fence, row.token),
            (last.fence, last.token),
            "the same grant"
        );
        if row.expires_at != last.expires_at {
            assert!(row.expires_at > last.expires_at, "renewals only extend it");
            renewals += 1;
        }
        last = row;
        attempts += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(attempts > 20);
    // Held across 4 ttls, so renewed about 12 times (every ttl/3 when on time); a slow
    // observer may see several renewals as one change.
    assert!(renewals >= 2, "{renewals} renewals seen");
    assert!(moved >= 2, "held_until moved {moved} times");
    let fence = guard.fence();
    assert!(last.token.is_some());
    drop(guard);
    // Released on drop, and nothing renews it any more (the bystander's renewer still runs).
    let released = raw_lease(&mut rival, "guarded");
    assert_eq!(released.token, None);
    std::thread::sleep(ttl);
    assert_eq!(
        raw_lease(&mut rival, "guarded"),
        released,
        "changed after release"
    );
    assert!(bystander.is_held());
    drop(bystander);

    let poll = Duration::from_millis(50);
    let started = Clock::now();
    let next = lease::take(
        &mut rival,
        "guarded",
        ttl,
        "rival",
        Wait::up_to(LONG).poll_interval(poll),
    )
    .unwrap()
    .expect("free after the guard dropped");
    assert!(started.elapsed() < poll * 10);
    assert!(next.fence() > fence);
}

fn guard_reports_loss_at_its_deadline_when_renewals_hang(backend: Backend) {
    let db = TestDb::migrated(backend);
    let ttl = Duration::from_millis(400);
    let guard = LeaseGuard::try_take(db.connect(), "stuck", ttl, "guard")
        .unwrap()
        .unwrap();
    let mut blocker = db.connect();
    let sql = format!(
        "UPDATE tenure_leases SET fence = fence WHERE name = {}",
        placeholders(backend, 1)
    );
    let started = Clock::now();
    // Another transaction holds the row's (SQLite: the database's) write lock, so renewals
    // block. The guard must give the lease up at its local deadline all the same.
    tenure::transaction(&mut blocker, |b| {
        diesel::sql_query(&sql)
            .bind::<Text, _>("stuck")
            .execute(b)?;
        assert!(
            guard.wait_lost(Duration::from_secs(10)),
            "never reported lost"
        );
        Ok::<_, Error>(())
    })
    .unwrap();
    let lost_after = started.elapsed();
    assert!(!guard.is_held());
    assert_eq!(guard.held_until(), None, "lost: held until nothing");
    // Deadline = sent + ttl - ttl/10: lost no later than the ttl, with a 10x margin on top.
    assert!(lost_after <= ttl * 10, "{lost_after:?}");
    drop(guard);
    println!("{backend} guard with hung renewals reported lost after {lost_after:?} (ttl {ttl:?})");
}

fn guard_stops_renewing_when_evicted(backend: Backend) {
    let db = TestDb::migrated(backend);
    let ttl = Duration::from_millis(300);
    let guard = LeaseGuard::try_take(db.connect(), "evict", ttl, "guard")
        .unwrap()
        .unwrap();
    let mut ops = db.connect();
    assert!(lease::force_release(&mut ops, "evict").unwrap());
    assert!(
        guard.wait_lost(ttl * 3),
        "the next renewal must notice the eviction"
    );
    let successor = lease::try_take(&mut ops, "evict", LONG, "successor")
        .unwrap()
        .unwrap();
    let row = raw_lease(&mut ops, "evict");
    std::thread::sleep(ttl);
    drop(guard);
    assert_eq!(
        raw_lease(&mut ops, "evict"),
        row,
        "the evicted guard touched the new grant"
    );
    tenure::transaction(&mut ops, |c| successor.verify(c)).unwrap();
}

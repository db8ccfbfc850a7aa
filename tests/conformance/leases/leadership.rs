//! Leadership at its edges: a force release never makes two leaders, resigning is prompt
//! while the campaign backs off, and waits of `Duration::MAX` do not panic.

use std::time::{Duration, Instant as Clock};

use tenure::lease::{self, Leadership, Take};
use tenure::{Backend, LeaseGuard};

use crate::common::{TestDb, conformance};

use super::line::until_in_line;

conformance!(
    a_force_release_does_not_make_two_leaders,
    resign_returns_promptly_while_the_campaign_backs_off_from_errors,
    wait_elected_for_duration_max_does_not_panic,
    a_guards_wait_lost_for_duration_max_does_not_panic,
    a_subscriber_after_the_election_hears_the_term_first,
);

const LONG: Duration = Duration::from_secs(120);

/// At most one candidate's `is_leader()` is true at any instant, also when an operator
/// force-releases the leader's lease: the next candidate is elected only after the lock delay
/// a leadership takes (one ttl), by when the deposed leader has seen its loss (at its next
/// renewal, ttl/3). Checked every millisecond from the force release to the new election.
fn a_force_release_does_not_make_two_leaders(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(6);
    let ttl = Duration::from_secs(3);
    let a = Leadership::campaign(&pool, "lead", ttl, "a", None).unwrap();
    assert!(a.wait_elected(Duration::from_secs(30)));
    let b = Leadership::campaign(&pool, "lead", ttl, "b", None).unwrap();
    let mut conn = db.connect();
    until_in_line(&mut conn, "lead", 1);
    assert!(lease::force_release(&mut conn, "lead").unwrap());
    let until = Clock::now() + Duration::from_secs(60);
    let mut checks = 0u64;
    while !b.is_leader() {
        assert!(
            Clock::now() < until,
            "b was not elected after the force release"
        );
        let (a_leads, b_leads) = (a.is_leader(), b.is_leader());
        assert!(
            !(a_leads && b_leads),
            "two leaders at once after a force release: a (fence {:?}) and b (fence {:?})",
            a.fence(),
            b.fence()
        );
        checks += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!a.is_leader(), "a still leads beside b");
    assert!(checks > 0);
}

/// Promise 6: resign returns promptly ("up to about half a second when not leading"). A
/// campaign whose takes fail (the name is held as a lease of 3: `LeaseHoldersMismatch`) backs
/// off in an uninterruptible sleep growing to 5 s, and resign waits it out.
fn resign_returns_promptly_while_the_campaign_backs_off_from_errors(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let mut conn = db.connect();
    let _three = Take::new("lead", LONG, "pool of 3")
        .holders(3)
        .on(&mut conn)
        .unwrap()
        .unwrap();
    let candidate = Leadership::campaign(&pool, "lead", LONG, "c", None).unwrap();
    // Backoffs 0.1, 0.2, 0.4, 0.8, 1.6, 3.2 s (6.3 s), then 5 s: at 7 s it sleeps 5 s.
    std::thread::sleep(Duration::from_secs(7));
    assert!(!candidate.is_leader());
    let started = Clock::now();
    candidate.resign();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "resign of a candidate that does not lead took {took:?}"
    );
}

/// Promise 8: `Leadership::wait_elected(Duration::MAX)` (wait "forever") must not panic.
fn wait_elected_for_duration_max_does_not_panic(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let me = Leadership::campaign(&pool, "lead", LONG, "me", None).unwrap();
    let elected = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        me.wait_elected(Duration::MAX)
    }));
    assert!(
        elected.is_ok(),
        "Leadership::wait_elected(Duration::MAX) panicked"
    );
}

/// Promise 8 (older code, same kind): a guard's `wait_lost(Duration::MAX)` must not panic.
fn a_guards_wait_lost_for_duration_max_does_not_panic(backend: Backend) {
    let db = TestDb::migrated(backend);
    let guard = LeaseGuard::try_take(db.connect(), "guarded", LONG, "g")
        .unwrap()
        .unwrap();
    // While held it would block: only whether it panics at once matters here.
    let h = std::thread::spawn(move || guard.wait_lost(Duration::MAX));
    std::thread::sleep(Duration::from_millis(500));
    if h.is_finished() {
        assert!(
            h.join().is_ok(),
            "LeaseGuard::wait_lost(Duration::MAX) panicked"
        );
    }
}

/// `changes()` called after the election starts with the current term's `Elected` (found
/// under load: a subscription made just after `campaign` missed it, and its first change was
/// a `Lost`), then the term's `Lost` at resignation.
fn a_subscriber_after_the_election_hears_the_term_first(backend: Backend) {
    let db = TestDb::migrated(backend);
    let pool = db.pool(4);
    let me = Leadership::campaign(&pool, "late", Duration::from_secs(30), "a", None).unwrap();
    assert!(me.wait_elected(Duration::from_secs(60)));
    let fence = me.fence().expect("leading");
    let changes = me.changes();
    assert_eq!(
        changes.try_recv(),
        Ok(lease::LeadershipChange::Elected { fence })
    );
    me.resign();
    assert_eq!(
        changes.recv_timeout(Duration::from_secs(60)),
        Ok(lease::LeadershipChange::Lost { fence })
    );
}

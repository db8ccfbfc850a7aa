//! What a take can ask beyond one holder: a lock delay after a lapse or a force release (not
//! after a clean release), a value published with the grant (fenced), and leader election
//! on top (one leader at a time, fences growing term by term).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenure::lease::{self, Leadership, LeadershipChange, Take};
use tenure::{AnyConnection, Backend};

use crate::common::{TestDb, conformance, poll_until, wait_for_db_clock};

conformance!(
    a_lapsed_or_evicted_holder_keeps_its_slot_for_the_lock_delay,
    a_value_is_written_only_by_the_holder_and_cleared_by_the_next_grant,
    one_leader_at_a_time_with_growing_fences_through_resignations,
);

const LONG: Duration = Duration::from_secs(120);
const HOUR: Duration = Duration::from_secs(3600);

/// Waits by the database's clock until `lease` has lapsed.
fn until_lapsed(conn: &mut AnyConnection, held: &lease::Lease) {
    wait_for_db_clock(conn, held.expires_at());
}

/// With a lock delay of an hour: a lease that lapsed is not granted again (nor after a force
/// release), its slot shows when it will be; one released cleanly is granted at once. The
/// same lapse without a delay is granted at once (the control).
fn a_lapsed_or_evicted_holder_keeps_its_slot_for_the_lock_delay(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let short = Duration::from_millis(300);

    // Lapsed: held back for the delay.
    let lapsed = Take::new("delayed", short, "paused")
        .lock_delay(HOUR)
        .on(&mut conn)
        .unwrap()
        .expect("free");
    until_lapsed(&mut conn, &lapsed);
    assert!(
        lease::try_take(&mut conn, "delayed", LONG, "next")
            .unwrap()
            .is_none()
    );
    let info = lease::inspect(&mut conn, "delayed").unwrap().unwrap();
    assert!(!info.held);
    assert!(
        info.reusable_at > info.now + chrono::Duration::minutes(50),
        "{info:?}"
    );

    // The control: the same lapse without a delay is granted at once.
    let undelayed = Take::new("undelayed", short, "paused")
        .on(&mut conn)
        .unwrap()
        .unwrap();
    until_lapsed(&mut conn, &undelayed);
    assert!(
        lease::try_take(&mut conn, "undelayed", LONG, "next")
            .unwrap()
            .is_some()
    );

    // Force-released: held back for the delay too (its holder may still be writing).
    let _evicted = Take::new("evicted", LONG, "stuck")
        .lock_delay(HOUR)
        .on(&mut conn)
        .unwrap()
        .unwrap();
    assert!(lease::force_release(&mut conn, "evicted").unwrap());
    assert!(
        lease::try_take(&mut conn, "evicted", LONG, "next")
            .unwrap()
            .is_none()
    );

    // Released cleanly: no delay.
    let mut clean = Take::new("clean", LONG, "tidy")
        .lock_delay(HOUR)
        .on(&mut conn)
        .unwrap()
        .unwrap();
    assert!(clean.release(&mut conn).unwrap());
    let next = lease::try_take(&mut conn, "clean", LONG, "next")
        .unwrap()
        .expect("free at once");
    assert!(next.fence() > clean.fence());

    // A renewal keeps the delay after the new expiry.
    let mut renewed = Take::new("renewed", LONG, "a")
        .lock_delay(HOUR)
        .on(&mut conn)
        .unwrap()
        .unwrap();
    renewed.renew(&mut conn, LONG).unwrap();
    let info = lease::inspect(&mut conn, "renewed").unwrap().unwrap();
    assert!(
        info.reusable_at >= info.expires_at + chrono::Duration::minutes(59),
        "{info:?}"
    );
}

/// The holder publishes a value that anyone reads; a lost holder's write is refused and
/// changes nothing; the next grant starts without it; a value too long is refused.
fn a_value_is_written_only_by_the_holder_and_cleared_by_the_next_grant(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let first = lease::try_take(&mut conn, "primary", LONG, "host-a")
        .unwrap()
        .unwrap();
    first.set_value(&mut conn, Some("10.0.0.7:8080")).unwrap();
    let info = lease::inspect(&mut conn, "primary").unwrap().unwrap();
    assert_eq!(info.value.as_deref(), Some("10.0.0.7:8080"));
    assert_eq!(
        lease::leader(&mut conn, "primary")
            .unwrap()
            .and_then(|l| l.value),
        Some("10.0.0.7:8080".into())
    );

    let too_long = "x".repeat(lease::MAX_VALUE_BYTES + 1);
    assert!(
        first
            .set_value(&mut conn, Some(&too_long))
            .unwrap_err()
            .is_invalid_input()
    );
    assert!(
        first
            .set_value(&mut conn, Some("a\0b"))
            .unwrap_err()
            .is_invalid_input()
    );
    let longest = "é".repeat(lease::MAX_VALUE_BYTES / 2);
    first.set_value(&mut conn, Some(&longest)).unwrap();
    assert_eq!(
        lease::inspect(&mut conn, "primary").unwrap().unwrap().value,
        Some(longest.clone())
    );

    assert!(lease::force_release(&mut conn, "primary").unwrap());
    assert!(
        first
            .set_value(&mut conn, Some("stale"))
            .unwrap_err()
            .is_lease_lost()
    );
    assert_eq!(
        lease::inspect(&mut conn, "primary").unwrap().unwrap().value,
        Some(longest)
    );
    assert!(lease::leader(&mut conn, "primary").unwrap().is_none());

    let second = lease::try_take(&mut conn, "primary", LONG, "host-b")
        .unwrap()
        .unwrap();
    assert_eq!(
        lease::inspect(&mut conn, "primary").unwrap().unwrap().value,
        None
    );
    // Inside a transaction that rolls back, the value does not stay.
    let rolled_back: Result<(), tenure::Error> = tenure::transaction(&mut conn, |c| {
        second.set_value(c, Some("uncommitted"))?;
        Err(tenure::Error::LeaseLost {
            name: "rollback".into(),
        })
    });
    assert!(rolled_back.is_err());
    assert_eq!(
        lease::inspect(&mut conn, "primary").unwrap().unwrap().value,
        None
    );
}

/// 4 candidates campaign; the leader resigns and another is elected, 12 terms. Whenever a
/// candidate says it leads, no other does (checked by a shared record of who leads), each
/// term's fence is greater than the last, every term's value names its leader, and each
/// candidate's change channel reports its terms in order.
fn one_leader_at_a_time_with_growing_fences_through_resignations(backend: Backend) {
    let db = TestDb::migrated(backend);
    let mut conn = db.connect();
    let ttl = Duration::from_secs(30);
    let candidates: Vec<Arc<Mutex<Option<Leadership>>>> = (0..4)
        .map(|i| {
            let pool = db.pool(4);
            let me = Leadership::campaign(
                &pool,
                "leader",
                ttl,
                &format!("c{i}"),
                Some(&format!("addr-{i}")),
            )
            .unwrap();
            Arc::new(Mutex::new(Some(me)))
        })
        .collect();
    let changes: Vec<_> = candidates
        .iter()
        .map(|c| c.lock().unwrap().as_ref().unwrap().changes())
        .collect();
    let mut fences = Vec::new();
    let mut resigned = [false; 4];
    for term in 0..12 {
        let leading = poll_until(LONG, Duration::from_millis(5), || {
            let now: Vec<usize> = (0..4)
                .filter(|i| {
                    candidates[*i]
                        .lock()
                        .unwrap()
                        .as_ref()
                        .is_some_and(|c| c.is_leader())
                })
                .collect();
            assert!(now.len() <= 1, "term {term}: {now:?} lead at once");
            now.first().copied()
        })
        .unwrap_or_else(|| panic!("term {term}: nobody was elected"));
        let fence = candidates[leading]
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .fence()
            .unwrap();
        let shown = lease::leader(&mut conn, "leader")
            .unwrap()
            .expect("a leader");
        assert_eq!(shown.fence, fence);
        assert_eq!(shown.holder, format!("c{leading}"));
        poll_until(LONG, Duration::from_millis(5), || {
            let shown = lease::leader(&mut conn, "leader").unwrap()?;
            (shown.value == Some(format!("addr-{leading}"))).then_some(())
        })
        .expect("the leader's value is published");
        if let Some(last) = fences.last() {
            assert!(fence > *last, "term {term}: fence {fence} after {last}");
        }
        fences.push(fence);
        // Every third term the leader resigns for good; otherwise it resigns and campaigns
        // again (a new Leadership).
        let me = candidates[leading].lock().unwrap().take().unwrap();
        me.resign();
        if term % 3 == 2 && resigned.iter().filter(|r| !**r).count() > 1 {
            resigned[leading] = true;
        } else {
            let pool = db.pool(4);
            let again = Leadership::campaign(
                &pool,
                "leader",
                ttl,
                &format!("c{leading}"),
                Some(&format!("addr-{leading}")),
            )
            .unwrap();
            *candidates[leading].lock().unwrap() = Some(again);
        }
    }
    // The first candidates' change channels: Elected then Lost, fences growing.
    for (i, changes) in changes.into_iter().enumerate() {
        let seen: Vec<LeadershipChange> = changes.try_iter().collect();
        let mut last = 0;
        for pair in seen.chunks(2) {
            let LeadershipChange::Elected { fence } = pair[0] else {
                panic!("candidate {i}: {seen:?}")
            };
            assert!(fence > last, "candidate {i}: {seen:?}");
            last = fence;
            if let Some(end) = pair.get(1) {
                assert_eq!(
                    *end,
                    LeadershipChange::Lost { fence },
                    "candidate {i}: {seen:?}"
                );
            }
        }
    }
    for candidate in candidates {
        drop(candidate.lock().unwrap().take());
    }
}

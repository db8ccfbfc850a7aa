//! One holder at a time: waiting takes, releases and expiry never overlap two holders, and a
//! guard renews after a long transaction of its caller's and releases after it.

use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tenure::jobs::{self, NewJob};
use tenure::lease::{self, Wait};
use tenure::{AnyConnection, Backend, Error, LeaseGuard};

use crate::common::{TestDb, conformance, poll_until};

conformance!(
    a_guard_renews_after_a_long_caller_transaction_and_releases_after_it,
    lease_holders_never_overlap_with_waiting_takes_releases_and_expiry,
);

/// Runs `f` on a thread of its own; panics (naming `what`) if it has not returned within
/// `bound`. A panic of `f` is passed on.
fn bounded<T: Send + 'static>(
    what: &str,
    bound: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (sender, receiver) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    match receiver.recv_timeout(bound) {
        Ok(value) => {
            let _ = thread.join();
            value
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the thread neither answered nor panicked"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not return within {bound:?} (hang or leaked lock)")
        }
    }
}

fn job(kind: &str) -> NewJob {
    NewJob::new("q", kind, vec![])
}

/// A LeaseGuard (ttl 30 s, renewing every 10 s on its own connection, busy timeout 5 s)
/// while the caller holds a tenure transaction (SQLite: the turn and the write lock) for 12 s,
/// spanning a renewal: the renewal waits and must land after the commit, so the lease stays
/// held. Then the guard is dropped inside another transaction held for 8 s (longer than
/// RELEASE_WAIT and the busy timeout): the drop returns, and the release must complete once
/// that transaction ends (bound 30 s).
fn a_guard_renews_after_a_long_caller_transaction_and_releases_after_it(backend: Backend) {
    let db = TestDb::migrated(backend);
    let ttl = Duration::from_secs(30);
    let guard = LeaseGuard::try_take(db.connect(), "guarded", ttl, "g")
        .unwrap()
        .expect("free");
    let first_expiry = guard.lease().expires_at();
    let mut caller = db.connect();
    tenure::transaction(&mut caller, |c| {
        jobs::enqueue(c, &job("long"))?;
        std::thread::sleep(Duration::from_secs(12));
        Ok::<_, Error>(())
    })
    .unwrap();
    let mut monitor = db.connect();
    poll_until(Duration::from_secs(30), Duration::from_millis(50), || {
        let row = lease::inspect(&mut monitor, "guarded").unwrap().unwrap();
        (row.expires_at > first_expiry).then_some(())
    })
    .expect("no renewal landed within 30 s after the caller's commit");
    assert!(
        guard.is_held(),
        "the guard lost its lease behind the caller's transaction"
    );
    tenure::transaction(&mut caller, |c| {
        jobs::enqueue(c, &job("long2"))?;
        drop(guard);
        std::thread::sleep(Duration::from_secs(8));
        Ok::<_, Error>(())
    })
    .unwrap();
    poll_until(Duration::from_secs(30), Duration::from_millis(50), || {
        let row = lease::inspect(&mut monitor, "guarded").unwrap().unwrap();
        (!row.held).then_some(())
    })
    .expect("the dropped guard's release never landed after the commit");
}

/// Four threads on their own connections, 12 grants each, by `lease::take` (waiting). A
/// winner proves it holds the lease by `verify` + the database clock in one tenure transaction
/// (a point of its holding by the database clock), then either releases or lets the lease
/// expire (ttl 30-150 ms). Afterwards, ordered by fence: fences rise with acquired_at, and
/// no grant is acquired before an earlier fence's last verified-held instant, or before an
/// expired-and-not-released earlier grant's expiry.
fn lease_holders_never_overlap_with_waiting_takes_releases_and_expiry(backend: Backend) {
    const THREADS: usize = 4;
    const GRANTS: usize = 12;
    let db = TestDb::migrated(backend);
    let url = db.url().to_string();
    struct Grant {
        fence: i64,
        acquired: DateTime<Utc>,
        expires: DateTime<Utc>,
        held_at: Option<DateTime<Utc>>,
        released: bool,
    }
    let (grants, errors) = bounded("the lease contest", Duration::from_secs(600), move || {
        let barrier = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let mut conn = AnyConnection::connect(&url).unwrap();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut grants = Vec::new();
                    let mut errors = Vec::new();
                    let mut i = 0;
                    while grants.len() < GRANTS {
                        i += 1;
                        let ttl = Duration::from_millis(30 + 40 * ((t + i) % 4) as u64);
                        let wait = Wait::up_to(Duration::from_secs(60))
                            .poll_interval(Duration::from_millis(5));
                        let lease = match lease::take(
                            &mut conn,
                            "contested",
                            ttl,
                            &format!("t{t}"),
                            wait,
                        ) {
                            Ok(Some(l)) => l,
                            Ok(None) => continue,
                            Err(e) => {
                                errors.push(format!("take: {e}"));
                                continue;
                            }
                        };
                        let held_at = tenure::transaction(&mut conn, |c| {
                            lease.verify(c)?;
                            tenure::database_now(c)
                        });
                        let held_at = match held_at {
                            Ok(at) => Some(at),
                            Err(e) if e.is_lease_lost() => None,
                            Err(e) => {
                                errors.push(format!("verify: {e}"));
                                None
                            }
                        };
                        let released = if i % 2 == 0 {
                            let mut lease = lease.clone();
                            match lease.release(&mut conn) {
                                Ok(r) => r,
                                Err(e) => {
                                    errors.push(format!("release: {e}"));
                                    false
                                }
                            }
                        } else {
                            false
                        };
                        grants.push(Grant {
                            fence: lease.fence(),
                            acquired: lease.acquired_at(),
                            expires: lease.expires_at(),
                            held_at,
                            released,
                        });
                    }
                    (grants, errors)
                })
            })
            .collect();
        let mut all = Vec::new();
        let mut errors = Vec::new();
        for t in threads {
            let (g, e) = t.join().expect("a contender panicked");
            all.extend(g);
            errors.extend(e);
        }
        (all, errors)
    });
    assert!(errors.is_empty(), "errors: {errors:#?}");
    let mut grants = grants;
    grants.sort_by_key(|g| g.fence);
    for pair in grants.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert_eq!(
            b.fence,
            a.fence + 1,
            "fences of the recorded grants are not consecutive"
        );
        assert!(
            b.acquired >= a.acquired,
            "fence {} acquired at {} before fence {} at {}",
            b.fence,
            b.acquired,
            a.fence,
            a.acquired
        );
        if let Some(held) = a.held_at {
            assert!(
                b.acquired >= held,
                "overlap: fence {} was verified held at {held}, but fence {} was acquired at {}",
                a.fence,
                b.fence,
                b.acquired
            );
        }
        if !a.released {
            assert!(
                b.acquired >= a.expires,
                "overlap: fence {} (not released) expires at {}, fence {} acquired at {}",
                a.fence,
                a.expires,
                b.fence,
                b.acquired
            );
        }
    }
}

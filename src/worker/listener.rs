//! On PostgreSQL, a listener that wakes the claimer when a job is enqueued in another
//! process (NOTIFY).

use super::runs::Shared;

/// Without PostgreSQL there is nothing to listen to.
#[cfg(not(feature = "postgres"))]
pub(super) fn listen(_shared: &Shared) {}

/// How often the listener reads its connection. diesel's notification iterator does not
/// block and does not expose the socket to wait on, so this bounds the added latency:
/// a read of nothing pending is one non-blocking `recv`, about a microsecond of CPU.
#[cfg(feature = "postgres")]
const LISTEN_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// LISTENs on a dedicated connection and wakes the claimer when a job is enqueued on one
/// of its queues; polls the connection every [`LISTEN_POLL`]; reconnects with backoff
/// when the connection breaks (polling keeps working).
#[cfg(feature = "postgres")]
pub(super) fn listen(shared: &Shared) {
    use std::time::Duration;

    use crate::backend::postgres::{autovacuum_is_off, listen, notified_queues};
    use crate::{BackendConnection, TenureConnection};

    let mut pause = Duration::from_millis(100);
    let mut checked_vacuum = false;
    while !shared.stopping() {
        let mut conn = match shared.config.pool.dedicated_connection() {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "listener: cannot connect; polling only");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        // Irrefutable when PostgreSQL is the only backend compiled in.
        #[allow(irrefutable_let_patterns)]
        let BackendConnection::Postgres(pg) = conn.backend_connection() else {
            return;
        };
        if !checked_vacuum {
            checked_vacuum = true;
            if let Ok(true) = autovacuum_is_off(pg) {
                tracing::warn!(
                    "PostgreSQL's autovacuum is off: nothing reclaims the dead row versions each \
                     job leaves in tenure_jobs, and claims slow down as they pile up \
                     (turn it on, or VACUUM tenure_jobs regularly)"
                );
            }
        }
        if let Err(e) = listen(pg) {
            tracing::warn!(error = %e, "listener: LISTEN failed");
            std::thread::sleep(pause);
            continue;
        }
        pause = Duration::from_millis(100);
        while !shared.stopping() {
            match notified_queues(pg) {
                Ok(queues) => {
                    for queue in &queues {
                        crate::wake::Waker::wake(shared, queue);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "listener: connection lost; reconnecting");
                    break;
                }
            }
            std::thread::sleep(LISTEN_POLL);
        }
    }
}

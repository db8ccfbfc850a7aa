//! Waiting for lease releases where the backend can be told of them: PostgreSQL's LISTEN on
//! the waiter's own connection (`tenure_leases`, the lease's name as payload). Elsewhere
//! nothing listens, and waiters poll.

use crate::TenureConnection;

#[cfg(feature = "postgres")]
pub(crate) fn can_listen<C: TenureConnection>(conn: &mut C) -> bool {
    matches!(
        conn.backend_connection(),
        crate::BackendConnection::Postgres(_)
    )
}

#[cfg(not(feature = "postgres"))]
pub(crate) fn can_listen<C: TenureConnection>(_conn: &mut C) -> bool {
    false
}

/// Starts or stops listening for lease releases on PostgreSQL; whether it listens. A failure
/// only costs wake-ups (the waiter still polls).
#[cfg(feature = "postgres")]
pub(crate) fn listen<C: TenureConnection>(conn: &mut C, on: bool) -> bool {
    #[allow(irrefutable_let_patterns)]
    let crate::BackendConnection::Postgres(pg) = conn.backend_connection() else {
        return false;
    };
    match crate::backend::postgres::listen_leases(pg, on) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(target: "tenure::lease", error = %e, on, "LISTEN for lease releases failed");
            false
        }
    }
}

#[cfg(not(feature = "postgres"))]
pub(crate) fn listen<C: TenureConnection>(_conn: &mut C, _on: bool) -> bool {
    false
}

/// Whether a notification says `name` was released (others are dropped).
#[cfg(feature = "postgres")]
pub(crate) fn released<C: TenureConnection>(conn: &mut C, name: &str) -> bool {
    #[allow(irrefutable_let_patterns)]
    let crate::BackendConnection::Postgres(pg) = conn.backend_connection() else {
        return false;
    };
    crate::backend::postgres::notified_queues(pg)
        .map(|names| names.iter().any(|n| n == name))
        .unwrap_or(false)
}

#[cfg(not(feature = "postgres"))]
pub(crate) fn released<C: TenureConnection>(_conn: &mut C, _name: &str) -> bool {
    false
}

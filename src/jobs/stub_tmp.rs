//! TEMPORARY: stands in for the SQL layer's claim_kinds and snooze until that branch merges.
use std::time::Duration;

use super::{ClaimedJob, JobClaim, Outcome};
use crate::{DibsConnection, Result};

/// Temporary.
pub const MAX_FREE_SNOOZES: u32 = 100;

/// Temporary.
pub fn claim_kinds<C: DibsConnection, K: AsRef<str>>(
    conn: &mut C,
    queue: &str,
    _kinds: &[K],
    limit: usize,
    ttl: Duration,
) -> Result<Vec<ClaimedJob>> {
    super::claim(conn, queue, limit, ttl)
}

/// Temporary.
pub fn snooze<C: DibsConnection>(
    conn: &mut C,
    claim: JobClaim,
    _delay: Duration,
) -> Result<Outcome> {
    Ok(super::give_back(conn, &[claim])?.remove(0))
}

//! Reading a job's park ([`park_record`]) for an operator: when, until when, and whether its
//! token was used. The token itself is never readable: only its hash is stored.

use chrono::{DateTime, Utc};
use diesel::prelude::*;

use crate::backend::dispatch;
use crate::schema::tenure_parked;
use crate::{Error, Result, TenureConnection};

/// A job's last park, from [`park_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkRecord {
    /// The job.
    pub job_id: i64,
    /// When the park was recorded (database clock).
    pub parked_at: DateTime<Utc>,
    /// When the job fails (or retries) unless answered (database clock).
    pub deadline: DateTime<Utc>,
    /// How its token was used: `complete`, `fail` or `resume`; `None` while it may be.
    pub answer: Option<String>,
    /// When its token was used.
    pub answered_at: Option<DateTime<Utc>>,
}

/// Job `id`'s last park, or `None` if it never parked (or retention deleted it with the job).
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// use std::time::Duration;
/// use tenure::jobs::{self, NewJob};
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// tenure::run_migrations(&mut conn)?;
/// let parked = jobs::enqueue_parked(&mut conn, &NewJob::new("q", "approve", vec![]), Duration::from_secs(3600))?;
/// let park = jobs::park_record(&mut conn, parked.id)?.unwrap();
/// assert!(park.deadline > park.parked_at);
/// assert_eq!(park.answer, None);
/// # Ok(()) }
/// ```
pub fn park_record<C: TenureConnection>(conn: &mut C, id: i64) -> Result<Option<ParkRecord>> {
    type Row = (
        DateTime<Utc>,
        DateTime<Utc>,
        Option<String>,
        Option<DateTime<Utc>>,
    );
    let row: Option<Row> = dispatch!(conn, c => {
        tenure_parked::table
            .find(id)
            .select((
                tenure_parked::parked_at,
                tenure_parked::deadline,
                tenure_parked::answer,
                tenure_parked::answered_at,
            ))
            .get_result(c)
            .optional()
            .map_err(Error::from)
    })?;
    Ok(
        row.map(|(parked_at, deadline, answer, answered_at)| ParkRecord {
            job_id: id,
            parked_at,
            deadline,
            answer,
            answered_at,
        }),
    )
}

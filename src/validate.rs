//! Checks on arguments, made in Rust before any statement runs (a non-strict MySQL would
//! silently truncate an over-long value).

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{Error, Result};

/// The longest name (lease, queue, kind, key), in bytes.
pub const MAX_NAME_BYTES: usize = 255;

/// A name compared byte for byte: not empty, at most [`MAX_NAME_BYTES`] bytes, no NUL (which
/// PostgreSQL's text cannot hold).
pub(crate) fn name(field: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes long, the limit is {MAX_NAME_BYTES}",
                value.len()
            ),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(field, "must not contain a NUL character"));
    }
    Ok(())
}

/// The longest free-text label (a lease's holder), in bytes.
pub const MAX_LABEL_BYTES: usize = 255;

/// The longest ttl tenure accepts. Longer is almost certainly a unit mistake (ms for s).
pub const MAX_TTL: Duration = Duration::from_secs(366 * 24 * 3600);

/// A free-text label for humans: at most [`MAX_LABEL_BYTES`] bytes, no NUL; may be empty.
pub(crate) fn label(field: &'static str, value: &str) -> Result<()> {
    if value.len() > MAX_LABEL_BYTES {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes long, the limit is {MAX_LABEL_BYTES}",
                value.len()
            ),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(field, "must not contain a NUL character"));
    }
    Ok(())
}

/// A free text of at most `max` bytes, no NUL (which PostgreSQL's text cannot hold).
pub(crate) fn text(field: &'static str, value: &str, max: usize) -> Result<()> {
    if value.len() > max {
        return Err(Error::invalid(
            field,
            format!("is {} bytes long, the limit is {max}", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(field, "must not contain a NUL character"));
    }
    Ok(())
}

/// A time to live: at least a millisecond (SQLite's clock resolution), at most [`MAX_TTL`].
/// Returns it in microseconds, the unit the SQL adds to the database clock.
pub(crate) fn ttl(ttl: Duration) -> Result<i64> {
    if ttl < Duration::from_millis(1) {
        return Err(Error::invalid(
            "ttl",
            format!("{ttl:?} is shorter than 1 ms"),
        ));
    }
    if ttl > MAX_TTL {
        return Err(Error::invalid(
            "ttl",
            format!("{ttl:?} is longer than {} days", MAX_TTL.as_secs() / 86400),
        ));
    }
    // At most 366 days in microseconds: far below i64::MAX.
    i64::try_from(ttl.as_micros()).map_err(|_| Error::invalid("ttl", "out of range"))
}

/// Priority aging's bound ([`crate::jobs::age_priorities`]), in microseconds: 1 ms to
/// [`MAX_TTL`], like a ttl.
pub(crate) fn aging_bound(after: Duration) -> Result<i64> {
    ttl(after).map_err(|_| {
        Error::invalid(
            "after",
            format!("{after:?} is not between 1 ms and 366 days"),
        )
    })
}

/// A delay (before a retry), in microseconds: at most [`MAX_TTL`].
pub(crate) fn delay_micros(delay: Duration) -> Result<i64> {
    if delay > MAX_TTL {
        return Err(Error::invalid(
            "delay",
            format!(
                "{delay:?} is longer than {} days",
                MAX_TTL.as_secs() / 86400
            ),
        ));
    }
    i64::try_from(delay.as_micros()).map_err(|_| Error::invalid("delay", "out of range"))
}

/// The earliest instant tenure stores, `0001-01-01T00:00:00Z`, in seconds since the epoch.
///
/// Years 1 to 9999 are what all three backends store and give back unchanged: MySQL's
/// `DATETIME` ends at 9999-12-31 (a later instant is stored as `0000-00-00` even in strict
/// mode), PostgreSQL counts year 0 and earlier as BC, and SQLite compares instants as text,
/// which orders correctly only for four-digit years (`+10000-...` sorts before `2025-...`).
pub(crate) const EARLIEST_INSTANT_SECS: i64 = -62_135_596_800;

/// The first instant past what tenure stores, `10000-01-01T00:00:00Z`, in seconds since the
/// epoch: the latest instant stored is just before it (`9999-12-31T23:59:59.999999Z`).
pub(crate) const END_OF_INSTANTS_SECS: i64 = 253_402_300_800;

/// An instant given by the caller (a due time, a retry time): from year 1 to year 9999, the
/// instants every backend stores and orders correctly (see [`EARLIEST_INSTANT_SECS`]). A
/// far-future instant meant as "never" (`DateTime::<Utc>::MAX_UTC`) is refused rather than
/// stored as something else.
pub(crate) fn instant(field: &'static str, at: DateTime<Utc>) -> Result<()> {
    use chrono::Timelike;
    // chrono writes a leap second as a nanosecond part past one second, which MariaDB turns
    // into the zero date.
    if at.nanosecond() >= 1_000_000_000 {
        return Err(Error::invalid(
            field,
            format!("{at} is a leap second, which not every database tenure supports stores"),
        ));
    }
    let secs = at.timestamp();
    if (EARLIEST_INSTANT_SECS..END_OF_INSTANTS_SECS).contains(&secs) {
        return Ok(());
    }
    Err(Error::invalid(
        field,
        format!("{at} is outside the years 1 to 9999, which every database tenure supports stores"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_in_bytes() {
        assert!(name("n", "job").is_ok());
        assert!(name("n", "").unwrap_err().is_invalid_input());
        assert!(name("n", &"x".repeat(255)).is_ok());
        assert!(name("n", &"x".repeat(256)).is_err());
        // 128 two-byte characters are 256 bytes.
        assert!(name("n", &"é".repeat(128)).is_err());
        assert!(name("n", "a\0b").is_err());
    }

    #[test]
    fn ttls_are_bounded() {
        assert!(ttl(Duration::ZERO).is_err());
        assert!(ttl(Duration::from_micros(999)).is_err());
        assert_eq!(ttl(Duration::from_millis(1)).unwrap(), 1000);
        assert!(ttl(MAX_TTL).is_ok());
        assert!(ttl(MAX_TTL + Duration::from_secs(1)).is_err());
        assert!(ttl(Duration::MAX).is_err());
    }

    #[test]
    fn instants_are_years_1_to_9999() {
        use chrono::TimeZone;
        let at = |y, mo, d, h, mi, s| Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap();
        assert!(instant("at", at(1, 1, 1, 0, 0, 0)).is_ok());
        assert!(instant("at", at(9999, 12, 31, 23, 59, 59)).is_ok());
        let last = at(9999, 12, 31, 23, 59, 59) + chrono::Duration::nanoseconds(999_999_999);
        assert!(instant("at", last).is_ok());
        assert!(
            instant("at", at(10000, 1, 1, 0, 0, 0))
                .unwrap_err()
                .is_invalid_input()
        );
        assert!(instant("at", at(0, 12, 31, 23, 59, 59)).is_err());
        assert!(instant("at", DateTime::<Utc>::MAX_UTC).is_err());
        assert!(instant("at", DateTime::<Utc>::MIN_UTC).is_err());
    }

    #[test]
    fn the_longest_delay_from_any_present_clock_stays_storable() {
        // Due times computed in SQL are the database's now plus at most MAX_TTL: they stay
        // below year 10000 for any clock before 9998-12-31.
        let now = DateTime::<Utc>::from_timestamp(END_OF_INSTANTS_SECS - 367 * 86_400, 0).unwrap();
        let latest = now + chrono::Duration::from_std(MAX_TTL).unwrap();
        assert!(instant("due", latest).is_ok());
    }

    #[test]
    fn labels_may_be_empty_but_not_long() {
        assert!(label("holder", "").is_ok());
        assert!(label("holder", &"h".repeat(256)).is_err());
        assert!(label("holder", "a\0").is_err());
    }
}

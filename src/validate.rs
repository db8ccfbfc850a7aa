//! Checks on arguments, made in Rust before any statement runs (a non-strict MySQL would
//! silently truncate an over-long value).

use std::time::Duration;

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

/// The longest ttl dibs accepts. Longer is almost certainly a unit mistake (ms for s).
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
    fn labels_may_be_empty_but_not_long() {
        assert!(label("holder", "").is_ok());
        assert!(label("holder", &"h".repeat(256)).is_err());
        assert!(label("holder", "a\0").is_err());
    }
}

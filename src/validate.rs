//! Checks on arguments, made in Rust before any statement runs (a non-strict MySQL would
//! silently truncate an over-long value).

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
            format!("is {} bytes long, the limit is {MAX_NAME_BYTES}", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(field, "must not contain a NUL character"));
    }
    Ok(())
}

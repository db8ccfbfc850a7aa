//! Durations on the command line: a whole number and a unit, always.

use std::time::Duration;

use crate::Failure;

/// The forms a duration may take, for error messages and help.
pub const FORMS: &str = "a whole number and a unit: ms, s, m, h or d (e.g. 500ms, 30s, 5m, 2h, 7d)";

const UNITS: [(&str, u64); 5] = [
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// `500ms`, `30s`, `5m`, `2h`, `7d`. A bare number is refused: is `5` seconds or minutes?
pub fn parse_duration(text: &str) -> Result<Duration, Failure> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if !number.is_empty() && unit.is_empty() {
        return Err(Failure::new(
            2,
            format!("{text:?} has no unit: write {text}s, {text}m, {text}h, {text}d or {text}ms"),
        ));
    }
    let bad = || Failure::new(2, format!("{text:?} is not a duration: use {FORMS}"));
    let n: u64 = number.parse().map_err(|_| bad())?;
    let millis = UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, millis)| *millis)
        .ok_or_else(bad)?;
    n.checked_mul(millis)
        .map(Duration::from_millis)
        .ok_or_else(bad)
}

/// [`parse_duration`] for the flag `flag`, named in the error.
pub fn parse_flag(flag: &str, text: &str) -> Result<Duration, Failure> {
    parse_duration(text).map_err(|failure| failure.prefixed(flag))
}

/// The longest delay, interval or age tenure's tables take (the library refuses longer ones).
pub const MAX: Duration = Duration::from_secs(366 * 86_400);

/// [`parse_flag`], and the duration between `min` and [`MAX`]: refused here, naming the
/// flag and the value as given, before any database is opened.
pub fn parse_flag_bounded(flag: &str, text: &str, min: Duration) -> Result<Duration, Failure> {
    let duration = parse_flag(flag, text)?;
    if duration < min || duration > MAX {
        return Err(Failure::new(
            2,
            format!(
                "{flag}: {:?} is not between {} and {}",
                text.trim(),
                format_duration(min),
                format_duration(MAX)
            ),
        ));
    }
    Ok(duration)
}

/// A duration in the largest unit that states it exactly: `5m`, `90s`, `1500ms`, `2d`.
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis == 0 {
        return "0s".to_string();
    }
    for (name, size) in UNITS {
        let size = u128::from(size);
        if millis % size == 0 {
            return format!("{}{name}", millis / size);
        }
    }
    // Finer than a millisecond: said in microseconds.
    format!("{}us", duration.as_micros())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_required_and_kept() {
        assert!(parse_duration("5").is_err());
        assert_eq!(parse_duration("5m").ok(), Some(Duration::from_secs(300)));
        assert_eq!(format_duration(Duration::from_secs(300)), "5m");
        assert_eq!(format_duration(Duration::from_secs(90)), "90s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(172_800)), "2d");
    }
}

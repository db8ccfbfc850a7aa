//! Attacks on `dibs serve` (written next).

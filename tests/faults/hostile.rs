//! Hostile input (filled in below).

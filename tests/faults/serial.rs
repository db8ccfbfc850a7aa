//! Scenarios that disturb other tests (filled in below).

//! Fault scenarios: killed worker processes (and how soon their jobs run again), a paused
//! lease holder, mutual exclusion across
//! processes, SQLite under contention, dropped connections, database restarts and hostile
//! input. Process-level scenarios run this same test binary as a child (`child::role`).
//!
//! `serial::*` disturbs other tests (it restarts servers): CI runs it alone, after the
//! parallel suite (see `.ci/run`).

// The harness shared by the three test binaries (see tests/common/mod.rs).
#[path = "../common/mod.rs"]
#[allow(dead_code, unused_macros, unused_imports)]
mod common;

mod child;
mod hostile;
mod leaders;
mod parked;
mod poison;
mod processes;
mod recovery;
mod script;
mod sequences;
mod serial;
mod steps;
mod takeover;
mod takeover_edges;
mod workflows;

//! tenure's conformance suite: every test is written once and runs against SQLite, PostgreSQL
//! and MySQL/MariaDB (each backend whose cargo feature is on).

// The harness shared by the three test binaries (see tests/common/mod.rs).
#[path = "../common/mod.rs"]
mod common;

mod bulk;
mod contention;
mod dedup_windows;
mod depth;
mod errors;
mod events;
mod flow_control;
mod foundation;
mod inputs;
mod jobs;
mod kinds;
mod leases;
mod migrations;
// Users and grants exist on the servers only.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod privileges;
mod queue_ops;
mod schedules;
mod schema_contract;
mod session_settings;
mod snooze;
mod statements;
mod testing_helpers;
mod typed;
// NOTIFY is PostgreSQL's.
#[cfg(feature = "postgres")]
mod wakeups;
mod worker;
mod workflows;
mod write_turns;

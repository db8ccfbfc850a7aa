//! tenure's conformance suite: every test is written once and runs against SQLite, PostgreSQL
//! and MySQL/MariaDB (each backend whose cargo feature is on).

// The harness shared by the three test binaries (see tests/common/mod.rs).
#[path = "../common/mod.rs"]
mod common;

mod attacks18;
mod attacks18b;
mod attacks18c;
mod attacks19;
mod attacks19b;
mod attacks19c;
mod attacks2;
mod attacks20;
mod attacks3;
mod attacks4;
mod attacks5;
mod bulk;
mod contention;
mod dedup_windows;
mod depth;
mod events;
mod flow_control;
mod foundation;
mod inputs;
mod jobs;
mod kinds;
mod leases;
mod limits;
// Users and grants exist on the servers only.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod privileges;
mod queue_ops;
mod schedules;
mod schema_contract;
mod snooze;
mod statements;
mod testing_helpers;
mod typed;
// NOTIFY is PostgreSQL's.
#[cfg(feature = "postgres")]
mod wakeups;
mod worker;
mod worker_attacks;
mod worker_liveness;
mod worker_runs;
mod workflow_races;
mod workflow_worker;
mod workflows;

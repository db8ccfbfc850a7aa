//! What holds on a cluster (issue 37), run by `scripts/test-clusters` against the clusters
//! `scripts/cluster-galera` and `scripts/cluster-postgres` start: ignored in the ordinary run
//! (no cluster is up there), and failing loudly when run without one.

mod galera;
mod galera_aborts;
mod galera_across_nodes;
mod galera_dependencies;
mod galera_race_dependents;
mod galera_races;
mod patroni;
mod patroni_lag;
mod patroni_through_failovers;

/// Runs `scripts/<script> <args>` (a node killed, restarted, a failover forced) and fails the
/// test if it fails.
fn cluster_script(script: &str, args: &[&str]) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(script);
    let status = std::process::Command::new(&path)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(status.success(), "{script} {args:?}: {status}");
}

/// Whether the cluster under test was started with synchronous replication
/// (`TENURE_TEST_PATRONI_SYNC=1`, set by `scripts/test-clusters`).
fn replication_is_synchronous() -> bool {
    std::env::var("TENURE_TEST_PATRONI_SYNC").is_ok_and(|v| v == "1")
}

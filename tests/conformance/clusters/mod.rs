//! What holds on a cluster (issue 37), run by `scripts/test-clusters` against the clusters
//! `scripts/cluster-galera` starts: ignored in the ordinary run (no cluster is up there), and
//! failing loudly when run without one.

mod galera;

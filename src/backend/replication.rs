//! Whether the database's commits survive a failover: what [`crate::replication`] reports. The
//! per-backend reads are beside each backend's [`super::Dialect`] (`fn replication`).

/// How the server a connection reaches replicates its commits, as far as a session can see.
///
/// A failover promotes a standby. With asynchronous replication the standby may not have the
/// last commits the old primary acknowledged: an enqueue, a completion or a lease grant that
/// returned `Ok` can be gone afterwards, and a lease's fence can be granted again (the next
/// grant counts from the fence the standby had). With synchronous replication a commit returns
/// only once a standby has it, and a failover to that standby keeps it.
///
/// ```
/// # fn main() -> Result<(), tenure::Error> {
/// let mut conn = tenure::AnyConnection::connect(":memory:")?;
/// match tenure::replication(&mut conn)? {
///     tenure::Replication::Asynchronous { standbys } => {
///         eprintln!("{standbys} standbys may miss acknowledged commits in a failover")
///     }
///     other => assert_eq!(other, tenure::Replication::Standalone),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replication {
    /// Nothing replicates from this server (SQLite; a PostgreSQL server no standby streams
    /// from; a MySQL/MariaDB server without a binary log): a commit is as durable as its disk.
    Standalone,
    /// Every commit waits for a standby or the cluster: PostgreSQL with
    /// `synchronous_standby_names` set and `synchronous_commit` at `on`, `remote_write` or
    /// `remote_apply`; a Galera node (every commit is certified by the cluster).
    Synchronous,
    /// `standbys` standbys stream from this PostgreSQL server without confirming commits
    /// (`synchronous_standby_names` empty, or `synchronous_commit` at `local` or `off`): a
    /// failover to one of them can lose the last acknowledged commits.
    Asynchronous {
        /// The standbys streaming from the server now.
        standbys: u32,
    },
    /// Cannot tell: a MySQL/MariaDB server with a binary log, which replicas may read without
    /// confirming commits (a session without the `PROCESS` privilege cannot see them).
    Unknown,
}

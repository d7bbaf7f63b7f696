//! The index's connections: to one standalone server, or to a Redis Cluster (redis-rs's
//! cluster client, which learns the slot map from any seed node, follows `MOVED` and `ASK`
//! redirections, and refreshes the map after a failover or a resharding). Connections are
//! pooled, one per concurrent caller, with read, write and connect timeouts; a connection
//! whose call failed is dropped.

use std::sync::Mutex;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{Connection, ConnectionLike};

use super::lock;
use crate::Error;

/// Where the connections go.
pub(super) enum Conns {
    /// One standalone server.
    Single { client: redis::Client, idle: Mutex<Vec<Connection>> },
    /// A Redis Cluster, reached from its seed nodes.
    Cluster { client: ClusterClient, idle: Mutex<Vec<ClusterConnection>> },
}

/// One pooled connection of either kind.
pub(super) enum Conn {
    Single(Connection),
    Cluster(Box<ClusterConnection>),
}

impl Conn {
    /// The connection, for commands and scripts (a Cluster routes each by its first key).
    pub(super) fn like(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Self::Single(c) => c,
            Self::Cluster(c) => &mut **c,
        }
    }

    /// Sends `pipe` and reads its replies: one round trip on a standalone server; on a
    /// Cluster each command goes to the node of its key (a pipeline of one shard's commands
    /// goes to one node).
    pub(super) fn pipeline(
        &mut self,
        pipe: &redis::Pipeline,
    ) -> redis::RedisResult<Vec<redis::Value>> {
        match self {
            Self::Single(c) => pipe.query(c),
            Self::Cluster(c) => {
                let mut cp = redis::cluster::cluster_pipe();
                for cmd in pipe.cmd_iter() {
                    cp.add_command(cmd.clone());
                }
                cp.query(c)
            }
        }
    }
}

/// Whether `e` is, or was caused by, an interrupted system call (`EINTR`).
fn interrupted(e: &redis::RedisError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// `result`, or, while the latest attempt failed with EINTR, what `again` gives: at most three
/// more attempts (see [`Conns::with`] for why an interrupted call is made again).
fn again_if_interrupted<T>(
    mut result: redis::RedisResult<T>,
    mut again: impl FnMut() -> redis::RedisResult<T>,
) -> redis::RedisResult<T> {
    for _ in 0..3 {
        if !result.as_ref().is_err_and(interrupted) {
            break;
        }
        result = again();
    }
    result
}

impl Conns {
    /// Whether these are a Cluster's.
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster { .. })
    }

    fn pooled(&self) -> Option<Conn> {
        match self {
            Self::Single { idle, .. } => lock(idle).pop().map(Conn::Single),
            Self::Cluster { idle, .. } => lock(idle).pop().map(|c| Conn::Cluster(Box::new(c))),
        }
    }

    fn give_back(&self, conn: Conn) {
        match (self, conn) {
            (Self::Single { idle, .. }, Conn::Single(c)) => lock(idle).push(c),
            (Self::Cluster { idle, .. }, Conn::Cluster(c)) => lock(idle).push(*c),
            _ => {}
        }
    }

    /// A fresh connection; one whose opening was interrupted (`EINTR` in its connect or its
    /// handshake's reads) is opened again, up to three more times.
    fn open(&self, timeout: Duration) -> Result<Conn, Error> {
        Ok(again_if_interrupted(self.open_once(timeout), || self.open_once(timeout))?)
    }

    fn open_once(&self, timeout: Duration) -> redis::RedisResult<Conn> {
        Ok(match self {
            Self::Single { client, .. } => {
                let c = client.get_connection_with_timeout(timeout)?;
                c.set_read_timeout(Some(timeout))?;
                c.set_write_timeout(Some(timeout))?;
                Conn::Single(c)
            }
            Self::Cluster { client, .. } => {
                let c = client.get_connection()?;
                c.set_read_timeout(Some(timeout))?;
                c.set_write_timeout(Some(timeout))?;
                Conn::Cluster(Box::new(c))
            }
        })
    }

    /// Runs `f` on a pooled connection; a connection whose call failed is dropped rather than
    /// pooled (it may hold half a reply, or the server may be gone).
    ///
    /// A pooled connection to a server that went away since it was pooled (the server was
    /// restarted) fails at once, closed; the call is then made once more on a fresh
    /// connection, so the first calls after a restart succeed. Making it again is safe: the
    /// server that closed the connection is gone, and with it whatever the call did there
    /// (unless it persisted it: then a lease is taken twice, and a call that must not act
    /// twice answers as it did the first time). A connection also drops when the server lives
    /// on (a proxy or a load balancer closed it after the call ran): that is why those calls
    /// keep their answers for a repeat.
    pub(super) fn with<T>(
        &self,
        timeout: Duration,
        mut f: impl FnMut(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        let pooled = self.pooled();
        let was_pooled = pooled.is_some();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.open(timeout)?,
        };
        let mut result = f(&mut conn);
        if was_pooled && result.as_ref().is_err_and(|e| e.is_connection_dropped()) {
            conn = self.open(timeout)?;
            result = f(&mut conn);
        }
        // A socket read that has a timeout fails with EINTR whenever its wait is interrupted
        // (the kernel never restarts those, SA_RESTART or not: signal(7)), and redis-rs hands
        // the EINTR up. Seen in this project's Python test processes (a dozen times in eight
        // runs of the pool suite) with no signal delivered to the thread (strace): not ours
        // to prevent. The connection's state is unknown then: the call is made again on a
        // fresh one. Every script is safe to run twice: a repeated lease is granted again
        // (one lease, its slots listed twice); a reserve, publish, removal, eviction or leave
        // keeps its answers under its call id, so its repeat answers as it did and does
        // nothing more (`scripts::repeat_window`): no second set of slots held until their
        // TTL, no `Expired` for a block it published, no `Absent` for one it removed, no "was
        // not alive" for the node it took out.
        let result = again_if_interrupted(result, || {
            conn = self.open_once(timeout)?;
            f(&mut conn)
        });
        if result.is_ok() {
            self.give_back(conn);
        }
        Ok(result?)
    }
}

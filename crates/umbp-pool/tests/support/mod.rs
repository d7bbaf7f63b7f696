//! Test support: a real `redis-server` on loopback (fresh port, temp dir, `requirepass`; from
//! umbp-pool's `redis-server` feature), started and stopped by the tests, and the suite of
//! rules every index backend must keep.

#![allow(dead_code, unreachable_pub)]

pub mod dram;
pub mod faults;
pub mod suite;

use std::time::Duration;

pub use umbp_pool::redis_server::RedisServer;
use umbp_pool::RedisConfig;

/// Settings for a client of the pool `prefix` on `server`, with a 2 s call timeout (a call to
/// a killed server fails in 2 s, not the default 5).
pub fn config(server: &RedisServer, prefix: &str) -> RedisConfig {
    let mut c = server.config(prefix);
    c.timeout = Duration::from_secs(2);
    c
}

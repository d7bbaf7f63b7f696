//! The peers the benches measure umbp against, one driver each: `ucx_perftest` (UCX's own
//! benchmark, the ceiling of one-sided gets over a transport) and Mooncake Transfer Engine
//! (the transfer engine users would pick instead, run from PyPI's wheel in a cached venv), and
//! Mooncake Store (the distributed KV store users would pick instead of umbp's pool, from the
//! same wheel).
//! Each driver only runs its peer and reads its figure back; the timing discipline, medians,
//! ranges and verdicts are [`crate::measure`]'s, shared by every bench.

pub mod mooncake;
pub mod mooncake_store;
pub mod perftest;

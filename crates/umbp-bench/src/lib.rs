//! The workloads behind the `umbp-bench` command and the criterion benches.
//!
//! Each subcommand has a module that builds its workload, measures it and returns rows, plus
//! the table and the chart the command shows for them. Targets are checked as ratios inside one
//! run. Rows serialize to the JSON lines documented in the crate README.

// Workloads, one per subcommand.
#[cfg(feature = "engines")]
pub mod batch_bench;
#[cfg(feature = "engines")]
pub mod churn_bench;
#[cfg(feature = "engines")]
pub mod copy_bench;
#[cfg(feature = "engines")]
pub mod hbm_bench;
#[cfg(feature = "engines")]
pub mod layers_bench;
pub mod plan_bench;
#[cfg(feature = "engines")]
pub mod pool_bench;
#[cfg(feature = "engines")]
pub mod remote_bench;
#[cfg(feature = "engines")]
pub mod restore_bench;
#[cfg(feature = "engines")]
pub mod ssd_bench;
#[cfg(feature = "engines")]
pub mod tour;

// What the workloads share: shapes, buffers, counters, and the command's output.
pub mod alloc_count;
#[cfg(feature = "engines")]
pub mod ceiling;
pub mod chart;
pub mod counters;
#[cfg(feature = "engines")]
pub mod disk;
#[cfg(feature = "engines")]
pub mod host_buffer;
pub mod measure;
#[cfg(feature = "engines")]
pub mod peers;
pub mod progress;
pub mod report;
pub mod shape;
pub mod size;
#[cfg(feature = "engines")]
pub mod ssd_report;

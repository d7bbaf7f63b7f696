//! The workloads behind the `umbp-bench` command and the criterion benches.
//!
//! Each subcommand has a module that builds its workload, measures it and returns rows, plus
//! the table and the chart the command shows for them. Targets are checked as ratios inside one
//! run. Rows serialize to the JSON lines documented in the crate README.

// Workloads, one per subcommand.
pub mod batch_bench;
pub mod churn_bench;
pub mod copy_bench;
pub mod hbm_bench;
pub mod layers_bench;
pub mod plan_bench;
pub mod remote_bench;
pub mod restore_bench;
pub mod ssd_bench;
pub mod tour;

// What the workloads share: shapes, buffers, counters, and the command's output.
pub mod alloc_count;
pub mod ceiling;
pub mod chart;
pub mod counters;
pub mod disk;
pub mod host_buffer;
pub mod measure;
pub mod peers;
pub mod progress;
pub mod report;
pub mod shape;
pub mod size;
pub mod ssd_report;
